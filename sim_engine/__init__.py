"""GPU-free stand-in for a vLLM server: OpenAI API, prefix cache, real vLLM KV-event wire format."""
