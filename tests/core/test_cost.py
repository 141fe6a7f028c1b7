"""Step costs (core/cost.py): ``CachedForward`` runs the forward pass the engine's ``CachedLM`` runs,
so a measured cost is the cost of an engine step, with the whole head and with a draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from specops.core.cost import CachedForward, step_ms
from specops.serving.engine.kv import CachedLM


@pytest.mark.parametrize("which", ["target", "draft"])
def test_cached_forward_gives_the_engine_logits(served_pair, which):
    model = getattr(served_pair, which)  # the draft scores only its vocabulary's rows
    context, feed = list(range(3, 20)), [21, 22, 23, 24]
    lm, fwd = CachedLM(model), CachedForward(model)
    lm.forward(context, logits_to_keep=1)
    fwd.forward(context, logits_to_keep=1)
    for _ in range(2):  # the second round runs after a rollback to the context
        want, _ = lm.forward(feed, logits_to_keep=len(feed))
        got = fwd.forward(feed, logits_to_keep=len(feed))
        assert torch.equal(got, want)
        lm.rollback(len(context))
        fwd.rollback(len(context))
        assert fwd.num_cached == fwd.cache.get_seq_length() == len(context)


def test_step_ms_is_a_positive_median(tiny_target):
    assert step_ms(tiny_target, list(range(3, 20)), 3, reps=3, warmup=1) > 0
