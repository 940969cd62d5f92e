"""Discrete-event fleet simulator: the router's real policies and the control plane's real index,
with only the engines (sim_engine's cache + scheduler + cost model) and the clock simulated."""
