"""The OpenAI-compatible HTTP API: the same frontend as the gRPC API, another front door."""
