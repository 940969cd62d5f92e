"""The fleet's state, as the control plane holds it and every router's view of it replicates it.

- `registry.py`: workers (model, block size, endpoint, load, adapters), each with a small slot;
- `inflight.py`: every router's in-flight reservations and speculative claims;
- `entries.py`: what changes the state, encoded as the replicated log and the follow stream carry it;
- `apply.py`: `LogApplier`, the one code path that changes registry, index and claims.

The prefix index itself is `kvroute.prefix_index`.
"""
