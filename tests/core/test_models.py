"""Loading pairs from disk: safetensors only, and one shared tokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specops.core.errors import ModelConfigError, TokenizerMismatchError
from specops.core.models import load_model, load_model_dir, load_pair, tokenizer_hash
from tests.conftest import VOCAB, tiny_llama


def save_dir(path, words: list[str], seed: int):
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0], eos_token=words[0])
    tiny_llama(32, 1, seed=seed).save_pretrained(path, safe_serialization=True)
    hf.save_pretrained(path)
    return path


@pytest.fixture
def words():
    return [f"w{i}" for i in range(VOCAB)]


def test_load_pair_with_shared_tokenizer(tmp_path, words):
    target = save_dir(tmp_path / "t", words, 1)
    draft = save_dir(tmp_path / "d", words, 2)
    pair = load_pair(target, draft)
    assert pair.vocab_size == VOCAB and pair.draft is not None
    assert pair.tokenizer_sha256 == tokenizer_hash(pair.tokenizer)
    assert not any(p.suffix in {".bin", ".pt", ".pkl"} for p in target.iterdir())


def test_the_draft_runs_in_bfloat16_by_default_and_the_target_in_float32(tmp_path, words):
    save_dir(tmp_path / "target", words, 1)
    save_dir(tmp_path / "draft", words, 2)
    pair = load_model_dir(tmp_path)
    assert (pair.target.dtype, pair.draft.dtype) == (torch.float32, torch.bfloat16)
    assert load_model_dir(tmp_path, draft_dtype="float32").draft.dtype == torch.float32
    with pytest.raises(ModelConfigError, match="unknown draft dtype 'int8'"):  # float16 is a GPU precision now
        load_model_dir(tmp_path, draft_dtype="int8")


def test_loading_a_bfloat16_draft_leaves_the_default_dtype_alone(tmp_path, words, monkeypatch):
    """A hot-swap loads a draft while other threads serve: torch's process-wide default dtype
    must stay float32 throughout (a request finishing meanwhile built its records in bfloat16)."""
    from specops.core.models import load_model, prepare_for_decoding

    seen: list[torch.dtype] = []
    init = torch.nn.Embedding.__init__

    def spy(self, *args, **kwargs):
        seen.append(torch.get_default_dtype())
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Embedding, "__init__", spy)
    path = save_dir(tmp_path / "d", words, 2)
    model = load_model(path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert seen and set(seen) == {torch.float32}
    monkeypatch.undo()
    # the same model as from_pretrained(dtype=bfloat16) gives: weights bfloat16, rotary buffers float32
    ref = prepare_for_decoding(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval())
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in ref.named_buffers()}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_different_tokenizers_are_rejected(tmp_path, words):
    target = save_dir(tmp_path / "t", words, 1)
    draft = save_dir(tmp_path / "d", list(reversed(words)), 2)  # same size, different mapping
    with pytest.raises(TokenizerMismatchError, match="differs from the target's"):
        load_pair(target, draft)


def test_missing_or_pickled_weights_are_refused(tmp_path, words):
    target = save_dir(tmp_path / "t", words, 1)
    for f in target.glob("*.safetensors"):
        f.unlink()
    (target / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelConfigError, match="only safetensors"):
        load_pair(target)
    with pytest.raises(ModelConfigError, match="not a model directory"):
        load_pair(tmp_path / "nowhere")


def test_concurrent_loads_leave_weight_tying_alone(tmp_path, words):
    """transformers patches PreTrainedModel.tie_weights during a load and restores what it saw:
    overlapping loads in two threads left tying off for the process, and later models came with a
    meta lm_head (seen in a full test run). Loads hold LOAD_LOCK, so they never overlap."""
    import threading

    from transformers import PreTrainedModel

    original = PreTrainedModel.tie_weights
    save_dir(tmp_path / "m", words, 1)
    errors: list = []

    def load() -> None:
        try:
            for _ in range(3):
                load_model(tmp_path / "m")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and PreTrainedModel.tie_weights is original
    model = load_model(tmp_path / "m")
    assert all(p.device.type == "cpu" for p in model.parameters())
