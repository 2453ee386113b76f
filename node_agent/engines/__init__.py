"""Inference engines a node agent can drive (the embedded transformer and adapters)."""
