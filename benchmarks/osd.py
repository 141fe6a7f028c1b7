"""OSD benchmark: do drafts learn from production-shaped traffic they have never seen?

Reproduces Online Speculative Decoding (Liu et al., §5) on the bootstrapped pair with the
traffic an Instruct target serves: **chat requests** (system + user message through the
chat template, ``specops.workloads.chat_workload``) in three narrow domains the bootstrap corpus does
not contain — text-to-SQL (``sql``), grade-school math (``math``) and questions about
functions of pinned Python packages (``api``). Every request is distinct and served once.

How a request is served. Greedy speculative decoding accepts exactly the drafts the draft
proposes from the committed prefix, which is always the target's own output; so a
request's acceptance is fixed by the target's greedy continuation and the draft's argmax
at each position of it. The benchmark therefore:

1. generates each prompt's greedy continuation with the target once (prompts of equal
   length batched, no padding; cached on disk beside the models), with the target's
   top-64 distribution at every position;
2. serves a request to a draft by one forward of the draft over prompt + continuation and
   replays the engine's step rule (k drafted per step): accepted, drafted, the steps that
   ended in a rejection and the rejected positions come out exactly as the engine's;
3. logs it as serving does (``StreamLogger``), to a local stream one ``OnlineTrainer``
   consumes in the same process, one draft per cluster;
4. checks itself against the real engine: every ``--check-every``-th request is also
   decoded by ``SpecEngine``; output and acceptance must be the replayed ones.

**α is the paper's per-token α** (§3): Σ accepted / (Σ accepted + steps that ended in a
rejection) (``specops.serving.engine.types.token_alpha``); accepted ÷ drafted is reported beside it.

Arms, on the same held-out **probe** per domain (prompts never served; ``--probe`` each):

- ``static``: the bootstrap draft, never updated;
- ``gated``: the product's path: the requests are routed by a MiniLM router fitted on
  other prompts of the domains, each cluster's trainer updates go through the promotion
  gate (``specops.trainer.promote.judge``) and serving swaps in only promoted versions;
- ``ungated``: every update of the same trainer served as soon as it exists;
- ``offline``: the paper's offline baseline and this run's bound: the bootstrap draft
  distilled on the same served traffic at every output position, ``--offline-epochs``;
- ``generic_*``: the same online loop from a draft never distilled from the target
  (``specops.trainer.bootstrap.generic``), the paper's setting (``--no-generic`` skips it).

Also: a domain switch sql -> math -> sql on one draft, each later segment read as α after
50/150/300 requests of the new domain and requests until α is within 0.05 of the domain's
reference, for the gate's defaults (its window of recent held-out requests and its fresh
test-then-train requests) and, beside them, for other windows and amounts of fresh evidence
(``--gate-windows W:F``; ``0:0`` = the whole held-out set, the gate before issue 55; ``16:0`` the
gate before fresh evidence) judged on the same candidates; an audit of every
promotion (the promoted and the replaced version both serve the cluster's next
``--audit-window`` requests; a promotion whose per-token α difference has a 95 % interval
below zero is *worse*), tokens/s of the draft method with each arm's final draft against
target-only on probe prompts (the real engine, arms interleaved), and, with ``--grid``,
the recipe grid that chose the trainer's defaults. With ``--teacher-forward``, instead: the
same traffic logged as an external engine (vLLM) logs it, with no target distribution, against
our engine's records (``benchmarks/osd_teacher.py``).

The code lives in ``benchmarks/distill/``, one module per role; this script is its entry point and
keeps the names other scripts and tests import from ``benchmarks.osd``.

    .venv/bin/python benchmarks/osd.py --json benchmarks/out/osd.json
    .venv/bin/python benchmarks/osd.py --quick
    .venv/bin/python benchmarks/osd.py --grid --quick --json benchmarks/out/osd_grid.json
    .venv/bin/python benchmarks/osd.py --teacher-forward --requests 250 --probe 60 --json benchmarks/out/osd_teacher.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, trainer/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.distill import arms, cli, constants, doc, grid, learning, run, scope, served, speed, summary, tables
from benchmarks.distill.arms import shift_segments
from benchmarks.distill.constants import DOC_BEGIN, GRID_BEGIN, GRID_FACTORS
from benchmarks.distill.grid import _level_of, _recipe
from benchmarks.distill.learning import learning_run, offline_distill, online_config
from benchmarks.distill.run import main
from benchmarks.distill.scope import set_domains
from benchmarks.distill.served import (
    Served,
    build_workload,
    continuations,
    logged_result,
    pooled,
    probe,
    replay,
    serve,
    served_example,
)
from specops.core.models import load_model_dir
from specops.serving.proposers.catalogue import DEFAULT_K

_MODULES = (scope, constants, served, learning, arms, speed, grid, summary, tables, doc, cli, run)

__all__ = [
    "DEFAULT_K",
    "DOC_BEGIN",
    "GRID_BEGIN",
    "GRID_FACTORS",
    "Served",
    "_level_of",
    "_recipe",
    "build_workload",
    "continuations",
    "learning_run",
    "load_model_dir",
    "logged_result",
    "main",
    "offline_distill",
    "online_config",
    "pooled",
    "probe",
    "replay",
    "serve",
    "served_example",
    "set_domains",
    "shift_segments",
]


def __getattr__(name: str):
    """Any other name this module held before the split, from the module that holds it now;
    ``DOMAINS`` is read at each access (``set_domains`` replaces it)."""
    for module in _MODULES:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
