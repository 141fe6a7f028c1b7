"""The decoding engine: a request's decode session, the verifier (chains and token trees),
KV-cached models, cross-request batching of target passes, sampling and model loading."""
