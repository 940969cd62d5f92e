"""Worker agent: one per engine (GPU node); engine KV events -> kvroute block keys -> control plane.

Modules: `events` (engine-neutral decoded events), `msgpack_wire` (ZMQ frames and the shared batch
decoder), `vllm_wire` / `sglang_wire` / `trtllm_events` (pure decoders of each engine's format),
`block_resolver` (engine hash -> kvroute key per tier, idempotent set semantics), `zmq_source`
(SUB + sequence tracking + DEALER replay), `trtllm_poller` (TRT-LLM's pull path), `dp_endpoints`
(data-parallel port offsets), `control_plane_client` (the `ControlPlane.Connect` stream: register,
snapshot, deltas, heartbeats, reconnect), `engine_metrics` (engine load from its /metrics),
`engine_models` (served model and LoRA adapters), `agent` (wires them, one worker per DP rank, own
/metrics and /health), `cli` (`kvroute agent`).
"""
