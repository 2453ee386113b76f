"""Live trace replay (``kvc bench live``): a Mooncake trace sent to a running
OpenAI-compatible server, summarised like the simulator's replay (``kvc bench compare``
puts the two side by side).

Modules
    ``prompts``   deterministic prompts that keep the trace's prefix structure exactly
    ``schedule``  open-loop arrivals at trace time x ``time_scale`` / ``speed``, bounded
                  concurrency, an injectable clock
    ``client``    one streamed ``/v1/completions`` request, timed (httpx)
    ``records``   a live result -> the simulator's ``RequestRecord``; live-only figures
    ``run``       the replay: summary.json, requests CSV, plots
    ``compare``   one table (and PNG) of several runs' summaries

Design and what each figure means: docs/simulator.md, "Live replay".
"""
