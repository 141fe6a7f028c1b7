"""Retrieval for drafting and for retrieval-augmented generation: knowledge bases,
datastores and their indexes (DReSD, RaLMSpec, kNN-LM, LLMA fill it)."""
