"""KV-cache tiers below the device pool: host memory, local disk and a remote store (Redis).

`cache.tiers.base` says what a tier declares, `cache.tiers.factory` builds each kind from its
options, and `TierChain` moves blocks between them beside the engine's step loop; see
docs/tiers.md.
"""
