"""KVGate engine package."""
