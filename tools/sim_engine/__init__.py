"""GPU-free stand-in for a vLLM, SGLang or TensorRT-LLM server: OpenAI API, prefix cache, real KV events.

Pure, clock-free parts (reused by the fleet simulator; no asyncio, no I/O):
  prefix_cache.PrefixCache   block pool: chained hashes per namespace, pinning, LRU eviction, optional
                             CPU offload tier, events; optional per-block records (published hash, kvroute key)
  cost_model.CostModel       step time from prefill tokens, decode sequences, context and CPU-loaded tokens
  scheduler.Scheduler        continuous batching with chunked prefill; step() -> StepResult
  dialects                   what each engine/version sends (fields, encoding, hashes, framing, bind rule)
  engine_hashes              each engine's published block hash, and the labeler that attaches it
Runtime parts:
  wire_encoding              a dialect's msgpack batch
  kv_publisher.KvEventPublisher  ZMQ PUB + ROUTER replay, fault hooks
  trtllm_events.TrtllmEventQueue TensorRT-LLM's POST /kv_cache_events queue
  metrics                    vLLM / SGLang Prometheus names, TensorRT-LLM iteration stats
  engine.SimEngine           asyncio driver (scaled real time), adapters and salts, request streams
  tokenizer                  the model's tokenizer and chat template, rendered as vLLM renders them
  server                     aiohttp OpenAI-compatible HTTP API, audit and fault endpoints; cli = `kvroute sim-engine`
"""
