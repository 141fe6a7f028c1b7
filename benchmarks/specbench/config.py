"""Benchmark settings: domains, modes, the headline k, the bars, and ``BenchConfig``.

Split out of ``benchmarks/spec_decode.py``, which is the command.
"""

from __future__ import annotations

from dataclasses import dataclass

from specops.core.models import DEFAULT_DRAFT_DTYPE
from specops.paths import models_dir
from specops.serving.proposers.catalogue import DEFAULT_K

DOMAINS = ("code", "prose")
MODES = {"greedy": 0.0, "t0.7": 0.7}
"""Mode name -> temperature."""
K_SWEEP = (2, 3, 4, 6)
"""k values of the draft sweep (non-quick)."""
HEADLINE_K: int = DEFAULT_K["draft"]
"""The headline draft k: the engine's default k, fixed before any measurement."""
HF_PLD_NUM_TOKENS = 10
"""``prompt_lookup_num_tokens`` for HF prompt lookup (the value HF's docs use)."""
REFERENCE = "hf_target"
SUMMARY_KEYS = (
    "draft_vs_hf_assisted",
    "draft_vs_target_code",
    "greedy_identical",
    "target_vs_hf_target",
    "model",
    "tree_greedy_identical",
    "tree_chi2_p",
    "biased_rule_chi2_p",
    "default_vs_target_min",
    "target_vs_hf_target_min",
)
DOC_BEGIN = "<!-- BEGIN spec_decode (written by benchmarks/spec_decode.py; edits inside are overwritten) -->"
DOC_END = "<!-- END spec_decode -->"
BAR_VS_HF_ASSISTED = 1.1
BAR_VS_TARGET_CODE = 1.3
BAR_DEFAULT_VS_TARGET = 1.0
"""Serving's default method against our target-only loop, on each domain (the worse one counts)."""
BAR_TARGET_VS_HF_TARGET = 1.0
"""Our target-only loop against ``target.generate``, on each domain (the worse one counts)."""
OWN_ARMS = ("target", "draft", "pld", "auto")
"""Methods that run as an arm of their own name; serving's default, if another, runs as ``our_method``."""


def serving_setting(name: str):
    """A default of ``ServeConfig`` (``specops serve``'s), read when used: the benchmark measures
    what serving does today, not a copy of it."""
    from specops.serving.http.config import ServeKeys

    return ServeKeys.model_fields[name].default  # by flat key (serve.toml's, the flags')


def worst(ratios: dict[str, float | None]) -> float | None:
    """The smaller per-domain ratio (None when a domain has none): a bar that holds on both domains."""
    vals = list(ratios.values())
    return None if any(v is None for v in vals) else min(vals)


def default_arm(method: str) -> str:
    """The arm that measures serving's default method ``method``."""
    return method if method in OWN_ARMS else "our_method"


# ---------------------------------------------------------------- config
@dataclass
class BenchConfig:
    """Everything that changes the benchmark's numbers."""

    model_dir: str = str(models_dir())
    """Bootstrap directory with target/, draft/ and manifest.json."""
    prompts: int = 8
    """Held-out prompts per domain."""
    prompt_tokens: int = 96
    """Tokens per prompt."""
    max_new_tokens: int = 128
    """Tokens generated per request at most (the same for every method)."""
    k: int = HEADLINE_K
    """Headline draft k (pld uses serving.engine.spec.DEFAULT_K["pld"])."""
    sweep: tuple[int, ...] = K_SWEEP
    """Extra k values for ``draft``; empty with --quick."""
    adaptive: bool = True
    """Also run ``draft`` with ``adaptive_k`` (k <= max(sweep))."""
    threads: int = 2
    """torch CPU threads."""
    seed: int = 0
    """Prompt selection seed; sampling seeds are seed + prompt index."""
    cost_reps: int = 200
    """Timed forwards per model when measuring c."""
    draft_dtype: str = DEFAULT_DRAFT_DTYPE
    """Precision the draft runs in, ours and HF's assistant alike (serving's default; ``auto``:
    measured at load, ``specops.core.draft_dtype``; the results record what it resolved to)."""
    float32_arm: bool = True
    """With a bfloat16 draft, also run ``draft_float32`` (the same draft in float32) side by side."""
    quick: bool = False
    min_cpu_share: float = 0.6
    """A prompt is measured again when any of its runs got less CPU time than this share
    of its wall time (the process was paused or starved by another job)."""
    max_attempts: int = 4
    """Measurements of one prompt and mode at most."""
    retry_wait_s: float = 10.0
    """Pause before measuring a prompt again."""

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.max_new_tokens < 2 or self.prompt_tokens < 4:
            raise ValueError("need --prompts >= 1, --max-new-tokens >= 2 and --prompt-tokens >= 4")
        if self.k < 1 or any(k < 1 for k in self.sweep):
            raise ValueError("k values must be >= 1")
