"""kvroute's tools, not part of the product: the sim engine, the fleet simulator, the benchmarks, the
demo and the local-fleet harness they share. Installed as `kvroute.tools`; their own dependencies come
with the `kvroute[tools]` extra.

The product (`kvroute.*` outside this package) never imports from here. Within tools, the modules at
this level (`local_cluster`, `stats`, `tiny_model`, `disturbance`) are the shared helpers; `sim_engine`,
`simulator`, `bench` and `demo` import them, and one another only downwards (bench -> simulator ->
sim_engine), never in a circle.
"""
