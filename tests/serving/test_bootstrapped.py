"""The release gate on the real bootstrapped models, when they are cached.

Skipped (with the reason) on a machine where `specops bootstrap` has not run: it takes
10-15 minutes, too long for the test suite to do itself.
"""

from __future__ import annotations

import pytest

from serving.engine import SpecEngine
from serving.types import SamplingParams
from specops.paths import models_dir

MODEL_DIR = models_dir()


def _bootstrapped() -> bool:
    from trainer.bootstrap import is_bootstrapped

    return is_bootstrapped(MODEL_DIR)


pytestmark = [
    pytest.mark.bootstrapped,
    pytest.mark.skipif(not _bootstrapped(), reason=f"no bootstrapped models in {MODEL_DIR}; run `specops bootstrap`"),
]


@pytest.fixture(scope="module")
def engine():
    from serving.models import load_model_dir

    return SpecEngine(load_model_dir(MODEL_DIR))


@pytest.mark.parametrize("domain", ["code", "prose"])
def test_greedy_equality_on_bootstrapped_models(engine, domain):
    from specops.prompts import heldout_prompts

    prompts = heldout_prompts(MODEL_DIR, engine.pair.tokenizer, domain, 3, num_tokens=64, seed=7)
    assert len(prompts) == 3
    accepted = 0
    for prompt in prompts:
        ref = engine.generate(prompt.token_ids, SamplingParams(max_new_tokens=32), method="target")
        for method, k in (("draft", 2), ("draft", 5), ("pld", 4)):
            out = engine.generate(prompt.token_ids, SamplingParams(max_new_tokens=32), method=method, k=k)
            assert out.token_ids == ref.token_ids, (domain, method, k, prompt.source)
            accepted += out.stats.num_accepted
    assert accepted > 0  # a trained draft agrees with its target at least sometimes
