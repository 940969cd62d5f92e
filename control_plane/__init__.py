"""Control plane: the global prefix index (block key -> workers) and the worker registry, behind gRPC."""
