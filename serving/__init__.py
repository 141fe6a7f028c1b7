"""Serving: the decoding engine (``engine``), drafting methods (``proposers``), retrieval
(``retrieval``), the HTTP API (``http``) and fleet plumbing (``fleet``)."""
