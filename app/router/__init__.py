"""`kvgate route`: an OpenAI-compatible gateway in front of KVGate replicas that sends each request
to the replica holding the longest part of its prompt's prefix, weighed against its load
(docs/router.md)."""
