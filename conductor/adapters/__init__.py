"""I/O adapters of the conductor: gRPC to node agents (and, later, Redis)."""
