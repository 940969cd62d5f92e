"""The routing service: the objects a decision needs, built once from the router's flags, and the router's readiness."""
