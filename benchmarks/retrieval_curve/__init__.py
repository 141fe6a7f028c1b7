"""The parts of the retrieval curve (``benchmarks/dresd_curve.py`` is the benchmark, ``benchmarks/dresd.py
--curve`` the command): arms (the drafters replayed and decoded live) and report (summary, table, plot).
The data (documents, the target's greedy continuations, key states) and the run stay in dresd_curve.py."""
