"""Trace-driven discrete-event simulator of a kv-conductor fleet (``kvc bench replay``).

The simulator runs the product's own pure core — ``conductor.core.scheduler.Scheduler``
(Algorithm 1, admission, cost models that learn), ``conductor.core.prefix_index.PrefixIndex``
(the shadow index, fed from each node's block events) and ``node_agent.blocks.pool.BlockPool``
(each prefill node's KV cache, with TxAllocate / TxCommit / LOCK_ONLY migrations) — in
virtual time, with the hardware's behaviour taken from a profile (``profiles/*.json``).

Modules
    ``engine``     the event loop (virtual clock)
    ``profile``    hardware/model profiles: the truth for prefill, decode and transfer times
    ``trace``      Mooncake trace files, statistics, the unbounded-cache hit ratio
    ``workload``   synthetic workload generator (system prompts, sessions, Poisson arrivals)
    ``agentic``    agentic tool-loop sessions with prompt-cache breakpoints (``prompt-cache-ttl``)
    ``instances``  prefill (BlockPool, FIFO, chunked) and decode (continuous batching) nodes
    ``cluster``    one replay: the request lifecycle driving the scheduler's hooks
    ``metrics``    per-request records and the summary statistics
    ``scenario``   named experiment files (``scenarios/*.json``)
    ``replay``     scenario runner: summary.json, per-request CSVs, plots
    ``plots``      PNG plots (matplotlib imported lazily)
    ``vllm_sim``   a simulated vLLM engine process (``kvc sim-engine``, docs/fleet.md), timed by
                   the same profiles

Design, assumptions and how to add a profile or scenario: docs/simulator.md.
"""
