"""GPU-free stand-in for a vLLM server: OpenAI API, prefix cache, real vLLM KV-event wire format.

Pure, clock-free parts (reused by the fleet simulator; no asyncio, no I/O):
  prefix_cache.PrefixCache   vLLM-like block pool: chained engine hashes, pinning, LRU eviction, events
  cost_model.CostModel       step time from prefill tokens, decode sequences and context tokens
  scheduler.Scheduler        continuous batching with chunked prefill; step() -> StepResult
Runtime parts:
  kv_publisher.KvEventPublisher  ZMQ PUB + ROUTER replay in vLLM's map-era or array-era format
  engine.SimEngine               asyncio driver (scaled real time), vLLM metrics, request streams
  server                         aiohttp OpenAI-compatible HTTP API; cli = `kvroute sim-engine`
"""
