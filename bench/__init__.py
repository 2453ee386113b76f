"""Benchmarks, run on demand (never as timed unit tests). Each writes a table and a PNG."""
