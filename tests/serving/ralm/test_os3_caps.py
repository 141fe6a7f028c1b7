"""OS³'s settings for iterative RaLM: the γ cap that sets the stride (0.9 in serving, the
paper's 0.6 in PAPER_OS3) and the margin a predicted gain must clear before speculating."""

from __future__ import annotations

import inspect

import pytest

from specops.serving.ralm import loop
from specops.serving.ralm.os3 import PAPER_OS3, RALM_OS3, OS3Config, StrideScheduler, best_stride, speculation_pays


def test_serving_caps_gamma_at_0_9_and_the_paper_arm_at_0_6():
    assert RALM_OS3.gamma_max == 0.9 and RALM_OS3.allow_off
    assert PAPER_OS3.gamma_max == 0.6 and not PAPER_OS3.allow_off
    ours, paper = StrideScheduler(RALM_OS3), StrideScheduler(PAPER_OS3)
    for sched in (ours, paper):
        for _ in range(5):
            sched.observe_verification(3, 3, 0.55)  # every guess held; a search costs 1.5 speculation steps
            sched.observe_speculation(0.37)
    assert ours.gamma == pytest.approx(0.9) and paper.gamma == pytest.approx(0.6)
    # with the paper's cap OS³ cannot batch once a search costs more than a step; with 0.9 it does
    assert best_stride(0.9, 0.37, 0.55, asynchronous=False) > best_stride(0.6, 0.37, 0.55, asynchronous=False)
    assert ours.stride() > paper.stride() >= 1


def test_the_loop_schedules_with_the_serving_caps_by_default():
    assert "self.os3 or RALM_OS3" in inspect.getsource(loop.RalmGenerator._ralmspec)


def test_speculation_must_beat_ralmseq_by_the_margin():
    """At a predicted break-even the unmodelled overheads (worker hand-off, the interpreter lock,
    cache scoring) make speculation a measured loss: it must clear ``pay_margin``."""
    a, bs = 1.0, [0.3] * 16
    pays = [g / 1000 for g in range(0, 990) if speculation_pays(g / 1000, a, bs, asynchronous=True)]
    threshold = min(pays)  # the smallest γ at which some stride beats RaLMSeq at all
    assert not speculation_pays(threshold, a, bs, asynchronous=True, margin=0.05)
    assert speculation_pays(min(0.989, threshold + 0.1), a, bs, asynchronous=True, margin=0.05)
    assert OS3Config().pay_margin == 0.05
