"""KVGate app package."""
