"""The routing decision, pure: no await, no network, no clock. The HTTP router, the gRPC `Route` API,
the endpoint picker and the fleet simulator all run it.

- `candidates.py`: what a policy sees of each worker (the index's answer, load, in-flight work);
- `policies/`: the policies (`POLICIES`, `make_policy`), each a pure function of its input;
- `decide.py`: `decide(...)`, one decision from the known fleet, the index's answer and this
  router's own in-flight state, and `RouteDecision`, what a transport makes of it.

Where the index's answer comes from (the router's own view of the fleet, or a control-plane query)
is the caller's business (`kvroute.data_plane.service.routing`).
"""
