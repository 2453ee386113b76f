"""The kvc command line: serve a conductor or an agent, the demo, probes, benchmarks."""
