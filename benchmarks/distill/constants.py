"""The OSD benchmark's constants: its doc markers, the bars its summary holds runs to, the shift
run's windows, the plot's colours and the recipe grid's factors."""

from __future__ import annotations

import logging

log = logging.getLogger("bench.osd")

DOC_BEGIN = "<!-- BEGIN osd (written by benchmarks/osd.py; edits inside are overwritten) -->"
DOC_END = "<!-- END osd -->"
PARTS = ("main", "offline", "speed", "generic", "shift")
"""What ``--parts`` can split among processes (``--merge`` joins their reports)."""
GRID_BEGIN = "<!-- BEGIN osd-grid (written by benchmarks/osd.py --grid; edits inside are overwritten) -->"
GRID_END = "<!-- END osd-grid -->"
WINDOW = 100
"""Requests in a moving average of served α."""
TOPK = 64
"""Target log-probs kept per position (as serving logs them)."""
GAIN_BAR = 0.10
OFFLINE_FRACTION_BAR = 0.8
RECOVERY_MARGIN = 0.02
RECOVERY_BAR = 300
SHIFT_AT = (50, 150, 300)
"""Requests into a new segment of the shift run at which each arm's α is reported."""
SHIFT_WINDOW = 50
"""Requests pooled for a segment's α at a point (the trailing ones, all of the new domain)."""
AUTO_STATIC_BAR = 1.1
"""Issue 55: ``auto`` with the final champion at least this much faster than with the static draft."""
SHIFT_MARGIN = 0.05
"""Issue 55's bars: gated ≥ ungated − this after 150 requests; adapted within this of the reference."""
SHIFT_WINDOWS = ("16:0", "16:16", "16:64", "32:0", "0:0")
"""Gate arms measured beside the default in the shift run, ``W`` or ``W:F`` (held-out window W, 0 =
the whole held-out set; F fresh requests, 0 = held-out only): ``0:0`` is the gate before issue 55,
``16:0`` the one before fresh evidence."""
COLORS = {
    "static": "tab:blue",
    "gated": "tab:green",
    "ungated": "tab:olive",
    "offline": "tab:red",
    "generic_gated": "tab:purple",
    "generic_ungated": "tab:pink",
    "generic_static": "tab:gray",
}


# ---------------------------------------------------------------- the recipe grid (grid.py)
GRID_FACTORS: dict[str, list] = {
    "positions": ["rejected", "all"],
    "lr": [5e-4, 1e-3, 3e-3],
    "steps_per_update": [1, 4],
    "replay": ["clear", "recent"],
    "loss": ["fkl", "rkl", "jsd"],
    "sampling": ["teacher", "student", "mixed"],
}
GRID_CENTER = {
    "positions": "rejected",
    "lr": 5e-4,
    "steps_per_update": 1,
    "replay": "clear",
    "loss": "fkl",
    "sampling": "teacher",
}
"""The grid's center: OSD Algorithm 1 as the paper runs it (the rejected positions, the buffer
cleared after each update, one step per update at 5e-4, forward KL, teacher sampling: the
target's own served output). Each other run moves one factor from it; the last combines the
best level of each. ``sampling`` is the paper's Table 1 comparison: ``student`` samples each
request's continuation from the draft and ``mixed`` from ``mix·p + (1-mix)·q`` (λ =
``OnlineConfig.mix``), both scored by the target (``specops.trainer.sampling``)."""


GRID_BUDGET_S = 0.6
"""Trainer CPU seconds per request a default recipe may cost. The trainer must keep pace with
the traffic on the cores it is given (in the demo, one of two): serving a 48-token chat
request takes 2-3 s of one core on this machine, and a trainer that needs more than about a
fifth of that per request falls behind as traffic grows."""


OTHER_KEYS = (
    "clusters",
    "requests_per_cluster",
    "alpha_token_static",
    "alpha_token_gated",
    "alpha_token_ungated",
    "alpha_token_offline",
    "gain_gated",
    "gain_gated_min",
    "alpha_token_disjoint",
    "gain_template_disjoint",
    "gain_template_disjoint_min",
    "offline_fraction",
    "offline_fraction_min",
    "offline_swept",
    "baseline_10pct",
    "promotions",
    "worse_promotions",
    "auto_default_vs_static",
    "auto_default_vs_target",
    "auto_default_vs_static_min",
    "auto_default_vs_target_min",
    "auto_draft_step_share",
    "auto_offline_vs_static",
    "tokens_per_s_ratio",
    "engine_checks",
)
