"""Conductor: stateless OpenAI-compatible front end and KV-centric scheduler."""
