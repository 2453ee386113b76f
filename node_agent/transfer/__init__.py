"""KV transfer between agents: staging, sending, receiving, over a ``KvTransport``."""
