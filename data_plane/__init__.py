"""Data plane: stateless routers (OpenAI-compatible HTTP and gRPC Route) in front of the engines."""
