"""KV-cache tiers below the device pool: host memory, local disk (and, later, a remote store).

`TierChain` ties them together beside the engine's step loop; see docs/tiers.md.
"""
