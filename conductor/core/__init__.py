"""Pure scheduling core: no I/O, no asyncio, an injected clock."""
