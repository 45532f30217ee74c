"""KVGate tenants package."""
