"""The speculative-decoding benchmark's parts (``benchmarks/spec_decode.py`` is the command):
config, methods (the arms), costs (c and Eq. 2), run (interleaved timing, aggregation, summary),
report (table and docs)."""
