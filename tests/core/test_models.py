"""Loading pairs from disk: safetensors only, and one shared tokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specops.core import draft_dtype
from specops.core.errors import ModelConfigError, TokenizerMismatchError
from specops.core.models import (
    DEFAULT_DRAFT_DTYPE,
    load_model,
    load_model_dir,
    load_pair,
    prepare_for_decoding,
    resolve_dtype,
    tokenizer_hash,
)
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


def test_the_draft_dtype_is_measured_by_default_and_the_target_runs_in_float32(tmp_path, words, monkeypatch):
    """``auto`` (the default) on a draft too small to time is float32, every time; a named
    precision is taken as given."""
    monkeypatch.delenv(draft_dtype.ENV, raising=False)
    save_dir(tmp_path / "target", words, 1)
    save_dir(tmp_path / "draft", words, 2)
    pair = load_model_dir(tmp_path)
    assert DEFAULT_DRAFT_DTYPE == "auto" and (pair.target.dtype, pair.draft.dtype) == (torch.float32, torch.float32)
    assert pair.draft.draft_dtype_measurement["dtype"] == "float32"
    assert pair.draft.draft_dtype_measurement["reason"] == "small"
    assert not hasattr(pair.target, "draft_dtype_measurement")  # the target is never re-precisioned
    assert load_model_dir(tmp_path, draft_dtype="bfloat16").draft.dtype == torch.bfloat16
    assert load_model_dir(tmp_path, draft_dtype="float32").draft.dtype == torch.float32
    with pytest.raises(ModelConfigError, match="unknown draft dtype 'int8'; choose one of auto, "):
        load_model_dir(tmp_path, draft_dtype="int8")


def test_the_environment_forces_what_auto_means_and_nothing_else(tmp_path, words, monkeypatch):
    path = save_dir(tmp_path / "d", words, 2)
    monkeypatch.setenv(draft_dtype.ENV, "bfloat16")
    model = load_model(path, dtype="auto")
    assert model.dtype == torch.bfloat16 and model.draft_dtype_measurement["reason"] == "env"
    assert load_model(path, dtype="float32").dtype == torch.float32  # a named precision wins
    monkeypatch.setenv(draft_dtype.ENV, "half")
    with pytest.raises(ModelConfigError, match="SPECOPS_DRAFT_DTYPE='half' is not a precision"):
        load_model(path, dtype="auto")
    monkeypatch.setenv(draft_dtype.ENV, "float16")
    with pytest.raises(ModelConfigError, match="float16 needs a GPU"):
        load_model(path, dtype="auto")


def test_resolve_dtype_needs_the_model_for_auto(tmp_path, words, monkeypatch):
    monkeypatch.delenv(draft_dtype.ENV, raising=False)
    with pytest.raises(ModelConfigError, match="'auto' is chosen per model"):
        resolve_dtype("auto")
    model = load_model(save_dir(tmp_path / "d", words, 2))
    assert resolve_dtype("auto", model) == torch.float32 and model.dtype == torch.float32  # tiny: float32, untouched
    assert resolve_dtype("bfloat16") == torch.bfloat16 and resolve_dtype(torch.float32) == torch.float32


@pytest.mark.parametrize(
    "ms, chosen",
    [
        ({"float32": 5.2, "bfloat16": 3.1}, "bfloat16"),  # AMD EPYC with avx512_bf16: bfloat16 clearly faster
        ({"float32": 3.0, "bfloat16": 4.1}, "float32"),  # a CPU whose bfloat16 products are slow
        ({"float32": 5.0, "bfloat16": 4.6}, "float32"),  # within the margin: float32 kept
        ({"float32": 5.0, "bfloat16": 4.4}, "bfloat16"),
    ],
)
def test_the_chooser_keeps_bfloat16_only_when_clearly_faster(ms, chosen):
    assert draft_dtype.choose(ms) == chosen


def test_step_times_price_a_nominal_request():
    """Per drafted token: the prefill over ROUNDS * ROUND_K tokens, plus each round's 2-token
    catch-up step and ROUND_K - 1 one-token steps."""
    t = draft_dtype.StepTimes(prefill_ms=63.0, one_ms=1.0, two_ms=2.0)
    rounds, k = draft_dtype.ROUNDS, draft_dtype.ROUND_K
    assert t.ms_per_token == pytest.approx((63.0 + rounds * (2.0 + (k - 1) * 1.0)) / (rounds * k))


def _tied(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return prepare_for_decoding(LlamaForCausalLM(cfg).eval())


def test_auto_keeps_the_faster_copy_and_remembers_the_architecture(monkeypatch):
    """The timing is injected (real timings are the benchmark's business): the faster arm is kept,
    the other dropped; a second draft of the same architecture gets the same precision without
    being timed (a reload or hot-swap never changes precision), another architecture is timed."""
    monkeypatch.setattr(draft_dtype, "CHOICES", {})
    monkeypatch.delenv(draft_dtype.ENV, raising=False)
    calls: list[dict] = []
    faster = {"bfloat16": 3.1, "float32": 5.2}

    def timer(arms):
        calls.append({name: (m, m.dtype) for name, m in arms.items()})
        return {name: draft_dtype.StepTimes(0.0, faster[name], faster[name]) for name in arms}  # ms/token = faster

    model = _tied(1)
    kept = draft_dtype.settle(model, timer=timer, min_bytes=0)
    assert len(calls) == 1 and calls[0]["float32"] == (model, torch.float32)
    assert calls[0]["bfloat16"][1] == torch.bfloat16 and calls[0]["bfloat16"][0] is kept
    assert kept.dtype == torch.bfloat16 and model.dtype == torch.float32  # the timed copy, the original untouched
    assert kept.lm_head.weight is kept.model.embed_tokens.weight  # tying survives the copy
    assert {n: b.dtype for n, b in kept.named_buffers()} == {n: b.dtype for n, b in model.named_buffers()}
    rec = kept.draft_dtype_measurement
    assert (rec["dtype"], rec["reason"], rec["cached"]) == ("bfloat16", "timed", False)
    assert rec["ms_per_token"] == pytest.approx(faster)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(kept(ids).logits.argmax(-1), model(ids).logits.argmax(-1))

    faster = {"bfloat16": 9.0, "float32": 1.0}  # would now choose float32 if it were timed again
    again = draft_dtype.settle(_tied(1), timer=timer, min_bytes=0)
    assert len(calls) == 1 and again.dtype == torch.bfloat16 and again.draft_dtype_measurement["cached"]

    other = _tied(2)
    assert draft_dtype.settle(other, timer=timer, min_bytes=0) is other  # float32 won: the model itself, kept
    assert len(calls) == 2 and other.dtype == torch.float32
    assert other.draft_dtype_measurement["ms_per_token"] == pytest.approx(faster)


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


def test_the_real_timing_runs_both_arms_through_the_engines_forward(monkeypatch):
    """The timer itself on a tiny draft with a draft vocabulary (how fast is not tested): both arms
    timed, and what is kept is what the chooser says of those numbers."""
    from specops.core import draft_vocab

    monkeypatch.setattr(draft_dtype, "CHOICES", {})
    monkeypatch.delenv(draft_dtype.ENV, raising=False)
    model = _tied(1)
    key = draft_dtype.arch_key(model)
    draft_vocab.attach(model, draft_vocab.DraftVocab(torch.arange(0, VOCAB, 2), VOCAB))
    assert draft_dtype.arch_key(model) != key  # a smaller head is another measurement
    monkeypatch.setattr(draft_dtype, "REPS", 1)
    kept = draft_dtype.settle(model, min_bytes=0)
    rec = kept.draft_dtype_measurement
    assert set(rec["steps_ms"]) == {"float32", "bfloat16"}
    assert all(v > 0 for steps in rec["steps_ms"].values() for v in steps.values())
    assert rec["dtype"] == draft_dtype.choose(rec["ms_per_token"]) and kept.dtype == getattr(torch, rec["dtype"])
    assert draft_vocab.of(kept) is not None and draft_vocab.of(kept).size == len(range(0, VOCAB, 2))


def test_a_config_only_target_has_its_limits_and_no_weights(tmp_path, words):
    """The front door over vLLM loads the target's config, not its weights: the same vocabulary,
    context and end ids, parameters on the meta device, and a refusal (not a wrong answer) when
    something asks it for hidden states."""
    from specops.core.embed import make_embedder
    from specops.core.errors import SpecOpsError
    from specops.core.models import has_weights

    target = save_dir(tmp_path / "t", words, 1)
    draft = save_dir(tmp_path / "d", words, 2)
    full, lean = load_pair(target, draft), load_pair(target, draft, target_weights=False)
    assert (lean.vocab_size, lean.context_size, lean.eos_token_ids) == (
        full.vocab_size,
        full.context_size,
        full.eos_token_ids,
    )
    assert has_weights(full.target) and not has_weights(lean.target)
    assert all(p.device.type == "meta" for p in lean.target.parameters())
    assert lean.draft is not None and has_weights(lean.draft)
    leaner = load_pair(target, draft, target_weights=False, draft_weights=False)  # the front door over vLLM
    assert not has_weights(leaner.draft) and leaner.draft.config.vocab_size == full.draft.config.vocab_size
    assert leaner.draft.config._name_or_path == str(draft)  # where a recount loads it from (specops.serving.vllm.node)
    with pytest.raises(SpecOpsError, match="target's weights"):
        make_embedder("target", target=lean)


def test_the_front_door_without_the_targets_weights_holds_less_memory(tmp_path):
    """RSS of a process that loads a pair, with and without the target's weights (a 100 MB target)."""
    import json
    import subprocess
    import sys

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8
    )
    words = [f"w{i}" for i in range(VOCAB)]
    target = save_dir(tmp_path / "t", words, 1)
    LlamaForCausalLM(cfg).save_pretrained(target, safe_serialization=True)  # ~25M params: ~100 MB in float32
    code = (
        "import json, sys; from specops.core.models import load_pair; "
        "pair = load_pair(sys.argv[1], None, target_weights=sys.argv[2] == '1'); "
        "rss = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0]; "
        "print(json.dumps({'rss_kb': rss}))"
    )
    rss = {}
    for weights in ("1", "0"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(target), weights], capture_output=True, text=True, check=True, timeout=300
        )
        rss[weights] = json.loads(out.stdout.strip().splitlines()[-1])["rss_kb"]
    weights_kb = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) * 4 / 1024
    assert rss["1"] - rss["0"] > 0.8 * weights_kb, (rss, weights_kb)
