"""A simulated vLLM 0.32 engine process (``kvc sim-engine``): vLLM's HTTP API, KV-cache
bookkeeping and KV events, with step times taken from a ``kvc_sim`` profile instead of
computing tokens, so a fleet of 16-64 engines runs on one small machine.

Modules
    ``hashing``    vLLM's engine block hashes (sha256 over pickles, chained; salt in block 0)
    ``cache``      the paged block pool with prefix caching, reference counts, LRU eviction
    ``kv_events``  KV events in vLLM's msgpack wire format; the ZMQ PUB + ROUTER replay publisher
    ``scheduler``  the engine core: continuous batching, chunked prefill, preemption, step times
    ``tokens``     deterministic output tokens and stop strings
    ``transfer``   prefill/decode hand-off through ``kv_transfer_params`` (NixlConnector-like)
    ``runner``     the engine loop in (scaled) real time, request streams
    ``protocol``   the OpenAI/vLLM request bodies and response shapes
    ``metrics``    ``/metrics`` with vLLM's metric names
    ``server``     the FastAPI app factory
    ``config``     the engine's configuration (``SimEngineConfig``, ``KvEventsConfig``)

It imports neither ``conductor`` nor ``node_agent`` (an engine, not our control plane:
pyproject's import-linter contract). Design and limits: docs/fleet.md.
"""
