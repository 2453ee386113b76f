"""OpenAI-compatible HTTP surface of the conductor: wire schemas and routes."""
