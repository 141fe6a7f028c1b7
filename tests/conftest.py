"""Shared fixtures: tiny random Llama models built in-process (no files, no hub)."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specops.core import draft_vocab
from specops.core.draft_vocab import DraftVocab
from specops.core.models import ModelPair, prepare_for_decoding
from specops.trainer.bootstrap import run as bootstrap

# Under pytest-xdist (`make test`: one worker per core) a second torch thread per worker would
# oversubscribe the cores, and the tiny models gain nothing from it. Code that needs both cores
# (the bootstrap, subprocesses) sets its own thread count. SPECOPS_TEST_THREADS=N overrides.
TEST_THREADS = int(os.environ.get("SPECOPS_TEST_THREADS") or (1 if os.environ.get("PYTEST_XDIST_WORKER") else 2))
torch.set_num_threads(TEST_THREADS)
# The same for the `specops` processes tests start without --threads (servers, trainers, the demo): their
# default (specops.cli.common.default_threads) would be every core, a second team beside the other worker's.
os.environ.setdefault("SPECOPS_THREADS", str(TEST_THREADS))

# Trainers, in this process and in the subprocesses it starts, split held-out records by the unkeyed hash:
# the same split on every run and in every process (a real trainer keys it: specops.trainer.online.trainer.holdout_key_for).
os.environ.setdefault("SPECOPS_HOLDOUT_KEY", "unkeyed")

# The vLLM servers tests start (and any process they start) run torch.compile'd helpers eagerly: vLLM
# compiles its sampler and logprob ops with inductor even under --enforce-eager, a C++ build of each on
# first use (about 40 s of CPU a server on a cold cache, several servers a run). The tests check
# behaviour, not speed; benchmarks keep vLLM's compile as its users run it.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

pytest_plugins = [
    "tests.registry.fixtures",
    "tests.schedule",
]  # real MLflow stores: sqlite_uri, pg_uri, mlflow_server, store_cfg


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Put torch's thread count back after a test that changed it (a benchmark or CLI run in-process sets
    its --threads): a later test in this worker would otherwise run a second team beside the other worker."""
    yield
    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


VOCAB = 97
EOS = 0


def tiny_llama(hidden: int, layers: int, *, seed: int, vocab: int = VOCAB, context: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.2,  # peaky logits: near-ties would make float noise decide argmax
        eos_token_id=None,  # tests that want EOS set it on the pair
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A copy of ``model`` with noise on every weight: a draft that agrees only partly."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return out


@pytest.fixture(scope="session")
def tiny_target() -> LlamaForCausalLM:
    return tiny_llama(64, 2, seed=1)


@pytest.fixture(scope="session")
def tiny_draft() -> LlamaForCausalLM:
    return tiny_llama(32, 1, seed=2)


@pytest.fixture(scope="session")
def tiny_pair(tiny_target, tiny_draft) -> ModelPair:
    """Target and an unrelated random draft: most drafts get rejected."""
    return ModelPair(target=tiny_target, draft=tiny_draft, tokenizer=None)


@pytest.fixture(scope="session")
def close_pair(tiny_target) -> ModelPair:
    """Target and a perturbed copy of it: acceptance is partial, rejections land everywhere."""
    return ModelPair(target=tiny_target, draft=perturbed(tiny_target, 0.05, seed=3), tokenizer=None)


SUBSET = sorted(random.Random(0).sample(range(VOCAB), 48))
"""The draft vocabulary of ``served_pair``'s draft: half of the tokens."""


@pytest.fixture(scope="session")
def served_pair(tiny_target) -> ModelPair:
    """``close_pair`` as serving loads it: few-row products as ``W @ xᵀ`` (``specops.core.cpu_linear``) in
    both models, a draft in bfloat16 (serving's default draft precision) that scores only the
    ``SUBSET`` of its vocabulary (``specops.core.draft_vocab``)."""
    target = prepare_for_decoding(copy.deepcopy(tiny_target))
    draft = prepare_for_decoding(perturbed(tiny_target, 0.05, seed=3).to(torch.bfloat16))
    draft_vocab.attach(draft, DraftVocab(torch.tensor(SUBSET), VOCAB))
    return ModelPair(target=target, draft=draft, tokenizer=None)


@pytest.fixture(scope="session")
def twin_pair(tiny_target) -> ModelPair:
    """Target and an exact copy as draft: greedy drafts are always accepted."""
    return ModelPair(target=tiny_target, draft=copy.deepcopy(tiny_target), tokenizer=None)


def random_prompts(n: int, seed: int, lo: int = 2, hi: int = 24, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        prompts.append(torch.randint(1, vocab, (length,), generator=g).tolist())
    return prompts


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A --tiny bootstrap (random target and draft with a real tokenizer on disk, seconds)."""
    out = tmp_path_factory.mktemp("bench") / "models"
    bootstrap(out, tiny=True)
    return out


@pytest.fixture
def calibrate_once(monkeypatch):
    """``specops.core.cpu_linear.calibrate`` measures a model population (the same weight shapes, as
    many modules of each) once in this test and gives a reload of it the routes it measured. The
    routes are a timing (they differ from one load to the next anyway) and every route computes the
    same product, so a reload keeps what a test proves; it skips re-timing every linear layer of a
    135M target (a minute on a loaded 2-core machine)."""
    from specops.core import cpu_linear

    real, measured = cpu_linear.calibrate, {}

    def calibrate(modules):
        groups: dict[tuple[int, int], int] = {}
        for m in modules:
            if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
                groups[tuple(m.weight.shape)] = groups.get(tuple(m.weight.shape), 0) + 1
        key = tuple(sorted(groups.items()))
        if key not in measured:
            measured[key] = real(modules)
            return measured[key]
        chosen = measured[key]
        bucket = {r: next(c for c in cpu_linear.CALIBRATION_ROWS if c >= r) for r in cpu_linear.ALL_ROWS}
        for m in modules:  # as calibrate sets them: the float32 CPU modules, by shape
            won = chosen.get(tuple(m.weight.shape))
            if won is not None and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
                wx = frozenset(r for r in cpu_linear.ALL_ROWS if won[bucket[r]] == "wx")
                onednn = frozenset(r for r in cpu_linear.ALL_ROWS if won[bucket[r]] == "onednn")
                m.set_routes(wx, onednn, won[cpu_linear.PREFILL_ROWS] == "onednn")
        return chosen

    monkeypatch.setattr(cpu_linear, "calibrate", calibrate)
    return measured


SMALL_DOCS = ("matplotlib", "pydantic", "click", "jinja2", "rich", "requests", "flask", "werkzeug", "alembic", "sympy")
"""The ``docs`` workload's packages (``specops.workloads.chat_workload.DOCS_PACKAGES``) but transformers, mlflow and
torch: 1,144 of the 5,068 files ``ast`` parses on a cold cache (which CI always has; about 45 s of
one core for all of them), still about 1,800 paragraphs with every held-out family among them."""


@pytest.fixture
def small_docs(monkeypatch):
    """The ``docs`` domain drawn from :data:`SMALL_DOCS` for one test (a full run's counts still fit)."""
    from specops.workloads import chat_workload as cw

    assert set(SMALL_DOCS) <= set(cw.DOCS_PACKAGES) and cw.HELD_OUT["docs"] <= set(SMALL_DOCS)
    whole = cw.doc_paragraphs

    def small(packages: tuple[str, ...] = SMALL_DOCS):
        return whole(packages)

    monkeypatch.setattr(cw, "doc_paragraphs", small)
    monkeypatch.setitem(cw._FINITE, "docs", small)
