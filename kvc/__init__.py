"""Shared pieces of kv-conductor: CLI, wire stubs, tokenization, model files."""
