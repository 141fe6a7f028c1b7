"""Code that runs inside a vLLM server (on its ``PYTHONPATH``, never importing specops)."""
