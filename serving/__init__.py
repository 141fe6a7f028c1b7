"""The decoding engine: proposers, the verifier, KV caches, and model loading."""
