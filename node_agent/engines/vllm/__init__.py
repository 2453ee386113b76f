"""The vLLM engine: an adapter driving a vLLM OpenAI server over HTTP (``adapter``), its
launch (``process``), configuration and tenant salts (``config``) and the mirror of its
KV cache from vLLM's KV events (``events``)."""
