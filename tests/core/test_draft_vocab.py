"""A draft's vocabulary subset (core/draft_vocab.py): the file, the logits, the cache of head
rows, loading from a model directory, and CachedLM's restricted forward."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specops.core import draft_vocab
from specops.core.draft_vocab import DraftVocab, DraftVocabError
from specops.core.errors import ModelConfigError
from specops.core.models import load_model
from specops.serving.engine.kv import CachedLM
from tests.conftest import VOCAB, tiny_llama
from tests.tolerances import assert_f32_close


def test_logits_are_the_head_rows_and_minus_inf_elsewhere():
    model = tiny_llama(32, 1, seed=4)
    ids = torch.tensor([0, 3, 7, 50, 96])
    vocab = DraftVocab(ids, VOCAB)
    hidden = torch.randn(3, 32)
    full = model.get_output_embeddings()(hidden)  # [3, V]
    got = vocab.logits(model.get_output_embeddings(), hidden)
    assert got.shape == (3, VOCAB)
    assert_f32_close(got[:, ids], full[:, ids])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(got[:, outside]).all() and (got[:, outside] < 0).all()
    assert set(got.argmax(-1).tolist()) <= set(ids.tolist())


def test_cached_rows_follow_an_in_place_weight_change():
    model = tiny_llama(32, 1, seed=4)
    head = model.get_output_embeddings()
    vocab = DraftVocab(torch.tensor([1, 2, 3]), VOCAB)
    before = vocab.rows(head).clone()
    assert vocab.rows(head) is vocab.rows(head)  # cached
    with torch.no_grad():
        head.weight.add_(1.0)  # what load_state_dict does on a hot-swap
    assert torch.equal(vocab.rows(head), before + 1.0)


@pytest.mark.parametrize(
    "ids, why",
    [
        ([], "non-empty"),
        ([3, 1], "sorted and unique"),
        ([1, 1], "sorted and unique"),
        ([0, VOCAB], "must lie in"),
        ([-1, 2], "must lie in"),
    ],
)
def test_bad_subsets_are_refused(ids, why):
    with pytest.raises(DraftVocabError, match=why):
        DraftVocab(torch.tensor(ids, dtype=torch.long), VOCAB)


def test_cached_lm_restricted_forward_matches_the_full_model(tmp_path):
    model = tiny_llama(32, 2, seed=5).eval()
    model.save_pretrained(tmp_path / "d", safe_serialization=True)
    ids = list(range(0, VOCAB, 2))
    draft_vocab.save(tmp_path / "d", DraftVocab(torch.tensor(ids), VOCAB), source="test")
    loaded = load_model(tmp_path / "d")
    assert draft_vocab.of(loaded) is not None and draft_vocab.of(loaded).size == len(ids)
    prompt = [5, 9, 11, 2, 40]
    full, _ = CachedLM(model).forward(prompt, logits_to_keep=2)
    lm = CachedLM(loaded)
    sub, hidden = lm.forward(prompt, logits_to_keep=2, want_hidden=True)
    assert_f32_close(sub[:, ids], full[:, ids])
    assert torch.isinf(sub[:, 1::2]).all() and hidden.shape == (2, 32)
    assert lm.num_cached == len(prompt) and lm.num_forwards == 1
    step, none = lm.forward([7], logits_to_keep=1)  # the cache keeps working after a restricted forward
    ref, _ = CachedLM(model).forward([*prompt, 7], logits_to_keep=1)
    assert none is None and int(step.argmax()) == int(ref[:, ids].argmax()) * 2


def test_malformed_file_is_a_clear_model_error(tmp_path):
    tiny_llama(32, 1, seed=6).save_pretrained(tmp_path / "d", safe_serialization=True)
    (tmp_path / "d" / draft_vocab.FILE).write_text(json.dumps({"format": draft_vocab.FORMAT, "token_ids": [1, True]}))
    with pytest.raises(ModelConfigError, match="integers"):
        load_model(tmp_path / "d")
    (tmp_path / "d" / draft_vocab.FILE).write_text("{not json")
    with pytest.raises(ModelConfigError, match="unreadable"):
        load_model(tmp_path / "d")
    (tmp_path / "d" / draft_vocab.FILE).write_text(json.dumps({"format": "other", "token_ids": [1]}))
    with pytest.raises(ModelConfigError, match="not a specops-draft-vocab/1 file"):
        load_model(tmp_path / "d")


def test_a_vocabulary_survives_deepcopy_and_is_removable():
    model = tiny_llama(32, 1, seed=4)
    draft_vocab.attach(model, DraftVocab(torch.tensor([1, 2]), VOCAB))
    assert draft_vocab.of(copy.deepcopy(model)).token_ids.tolist() == [1, 2]
    draft_vocab.attach(model, None)
    assert draft_vocab.of(model) is None and CachedLM(model).vocab is None
