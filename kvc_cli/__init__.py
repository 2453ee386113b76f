"""The kvc command line: serve a conductor or an agent, the demo, probes, benchmarks."""

import kvc  # noqa: F401  (first: gRPC's fork handlers off, see kvc/__init__.py)
