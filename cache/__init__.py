"""KVGate cache package."""
