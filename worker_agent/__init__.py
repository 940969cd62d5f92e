"""Worker agent: one per engine (GPU node); engine KV events -> kvroute block keys -> control plane.

Modules: `vllm_wire` (pure decoder of vLLM's ZMQ wire format, every era), `block_resolver`
(engine hash -> kvroute key, idempotent set semantics), `zmq_source` (SUB + sequence tracking +
DEALER replay), `control_plane_client` (the `ControlPlane.Connect` stream: register, snapshot,
deltas, heartbeats, reconnect), `engine_metrics` (engine load from its /metrics), `agent` (wires
them, own /metrics and /health), `cli` (`kvroute agent`).
"""
