"""The agent's input limits: what it accepts from an engine before it has looked at the content.

Each bounds what one message can make the agent allocate; input over a limit is dropped, counted
(`kvroute_agent_oversize_*`) and treated as a lost batch (gap, replay, or reset). Defaults are
set from the largest batch a real engine can send, with room to spare, so that only broken or
hostile input reaches them:

- A whole KV cache of a big node as one batch. DeepSeek-V3 (MLA, FP8 KV: 61 layers x 576 bytes
  = 35 KB per token) on 8 x H200 (141 GB each) leaves ~340 GB for KV after its ~670 GB of FP8
  weights at 90% memory use: ~9.8 M tokens. As msgpack token ids (5 bytes each above 65535) plus
  one 9-byte hash per 16-token block that is ~55 MB; SGLang's EAGLE bigram ids (`[a, b]` per
  position, 11 bytes) double it. Llama-3.1-70B with FP8 KV (160 KiB per token) on the same node:
  ~5.8 M tokens, ~32 MB. Engines send one batch per scheduler step, far less than a whole cache,
  so `DEFAULT_MAX_FRAME_BYTES` (128 MiB) is never reached by a real engine.
- Events per batch: the same cache evicted at once is ~610 k one-block BlockRemoved events (vLLM
  sends one per evicted block, 16-token blocks). `DEFAULT_MAX_BATCH_EVENTS` (2**20) is above it.
  The count is what bounds the work and memory of a batch the decoder has to take apart event by
  event (one object per element, ~50 bytes each, whatever the element's size, and a few microseconds
  of CPU: 2**20 garbage events take seconds, several times what as many valid ones cost in the
  one-call decode).
- TensorRT-LLM's pull path: one `POST /kv_cache_events` body holds the events since the previous
  poll (100 ms by default), at ~60 bytes of JSON per token of a stored block (each token is an
  object with its type, id and extra id). 64 MiB is about 1.1 M tokens of new blocks, over 10 s of
  a node prefilling 100 k tokens/s: a body that large means polls were failing for a long time, and
  the engine's own event buffer (`event_buffer_max_size`, 1024 events in TensorRT-LLM's
  `llm_inference_kv_events` example) will have overflowed already.
"""

from __future__ import annotations

DEFAULT_MAX_FRAME_BYTES = 128 << 20  # ZMQ MAXMSGSIZE of the SUB and replay DEALER sockets, per frame
DEFAULT_MAX_BATCH_EVENTS = 1 << 20  # events (elements) in one msgpack batch or pull-path body
DEFAULT_MAX_POLL_BYTES = 64 << 20  # TensorRT-LLM pull path: one POST /kv_cache_events response body
# One gRPC message to or from the control plane: a snapshot of a large cache is one message
# (a million keys is ~9 MB); the control plane's own default is the same.
DEFAULT_GRPC_MAX_MESSAGE_BYTES = 256 << 20

# Not flags. A replay answer is read whole before it applies: it stops after this many batches, 10x the
# replay buffer engines keep by default (`buffer_steps` 10000), so a peer that never ends its answer
# cannot grow it without bound.
MAX_REPLAY_BATCHES = 100_000

# Not a flag: a batch that msgspec cannot take apart (something nests past Python's recursion limit,
# which no engine does: events nest four levels deep) is split by a scanner that takes one Python step
# per value; only batches up to this size are, larger ones are dropped whole.
SCAN_MAX_BYTES = 1 << 20
