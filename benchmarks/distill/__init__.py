"""The OSD benchmark (``benchmarks/osd.py``, the script and its documentation), one module per role:

- ``constants``: doc markers, bars, the shift run's windows, plot colours, the grid's factors;
- ``scope``: the domains this process runs or reports (``--domains``; read ``scope.DOMAINS``);
- ``served``: the target's cached continuations, a request replayed to a draft, the probe, the workload;
- ``learning``: the offline baseline and the online run (trainers, the gate, the arms);
- ``arms``: the gate's windows side by side, the promotion audit, the domain switch;
- ``speed``: tokens/s against target-only, the cost ratio, the cost of every-position training;
- ``grid``: the recipe grid (``--grid``);
- ``summary``, ``tables``, ``doc``: a report's summary, its plot and table, its doc section;
- ``cli``: the command line; ``run``: a run, ``--replot`` and ``--merge``."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
