"""vLLM as the decoding engine behind our front door (``specops serve --engine vllm``)."""
