"""Benchmarks, run on demand (never as timed unit tests). Each writes a table and a PNG."""

import kvc  # noqa: F401  (first: gRPC's fork handlers off, see kvc/__init__.py)
