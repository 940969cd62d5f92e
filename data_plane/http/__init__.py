"""The OpenAI-compatible HTTP transport: its handlers, its error objects and the proxy to engines."""
