"""The soak-and-fault benchmark's parts (``benchmarks/faults.py`` is the command): stack (constants,
tiny models, the processes and what they expose), driver (the load and the kills), checks (the
invariants and the analysis), report (tables and the docs section)."""
