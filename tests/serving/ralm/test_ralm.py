"""RaLMSeq and RaLMSpec (``specops.serving.ralm.loop``) and OS³ (``specops.serving.ralm.os3``).

The loops run on the tiny bootstrap (random models, a real tokenizer) over a small
in-test retriever (hashed bag of words, exact inner product in float64: deterministic and
batch-independent, the contract of ``specops.serving.retrieval.retriever``). The real knowledge
bases and their retrievers are tested in ``tests/serving/retrieval/test_kb.py``; here the seam is the
retriever interface, and one test runs the loop over a real KB's retrievers.
"""

from __future__ import annotations

import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specops.core.errors import InvalidRequestError
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_proposer
from specops.serving.proposers.catalogue import ProposerResources, method_spec
from specops.serving.ralm.loop import Drafting, LocalCache, RalmConfig, RalmGenerator
from specops.serving.ralm.os3 import (
    OS3Config,
    StrideScheduler,
    best_stride,
    objective,
    rate_with_rework,
    speculation_pays,
)

TOPICS = [
    "disk partition table sector",
    "network socket packet route",
    "compiler linker object symbol",
    "printer queue spool job",
    "shell variable quote expand",
    "mail header recipient smtp",
]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class BagRetriever:
    """Exact inner product over hashed bags of words (float64, ties -> lower id)."""

    kind = "exact"

    def __init__(self, texts: list[str], dims: int = 64, delay_s: float = 0.0) -> None:
        self.dims, self.delay_s = dims, delay_s
        self.emb = np.stack([self._vec(t) for t in texts])
        self.calls: list[int] = []

    def _vec(self, text: str) -> np.ndarray:
        v = np.zeros(self.dims)
        for w in _words(text):
            h = int(hashlib.blake2b(w.encode(), digest_size=4).hexdigest(), 16)
            v[h % self.dims] += 1.0 if (h >> 20) & 1 else -1.0
        n = np.linalg.norm(v)
        return v / n if n else v

    def encode(self, texts):
        return [self._vec(t) for t in texts]

    def search(self, queries, k):
        self.calls.append(len(queries))
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow KB (releases the GIL, as torch and FAISS do)
        scores = np.stack(queries) @ self.emb.T
        order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores), axis=1)[:, :k]
        return order.astype(np.int64), np.take_along_axis(scores, order, 1).astype(np.float32)

    def score(self, queries, ids):
        return (np.stack(queries) @ self.emb[np.asarray(ids)].T).astype(np.float32)


@pytest.fixture(scope="module")
def pair(tiny_models):
    from specops.core.models import load_model_dir

    return load_model_dir(tiny_models)


@pytest.fixture(scope="module")
def passages() -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(60):
        words = TOPICS[i % len(TOPICS)].split()
        out.append(" ".join(rng.choice(words + ["the", "of", "and", f"item{i}"], size=12)))
    return out


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2, thread_name_prefix="ralm-test") as p:
        yield p


def _run(
    pair,
    retriever,
    passages,
    cfg,
    prompt,
    *,
    method="target",
    k=None,
    pool=None,
    max_new=24,
    temperature=0.0,
    concurrency=None,
    **filters,
):
    gen = RalmGenerator(
        SpecEngine(pair),
        retriever,
        lambda ids: [passages[i] for i in ids],
        pair.tokenizer,
        cfg,
        drafting=_drafting(pair, method, k),
        pool=pool,
        concurrency=concurrency,
    )
    return gen.generate(prompt, SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=5, **filters))


def _drafting(pair, method: str, k: int | None) -> Drafting:
    """``method``'s proposer, fresh for each segment, and its ``k`` (default: the method's)."""
    spec = method_spec(method)
    return Drafting(lambda: plain_proposer(ProposerResources(pair=pair), method), k or spec.default_k)


PROMPTS = ["disk partition table of the sector", "a network socket sends a packet", "the shell will expand a variable"]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),  # OS³ + prefetch 20 + async
        dict(speculation_off=False),  # the paper's OS³ (always speculates)
        dict(speculation_stride=3),  # no OS³ (the paper's fixed s = 3)
        dict(prefetch=1),  # no prefetch (top-1 cache update)
        dict(asynchronous=False),  # no async
        dict(speculation_stride=5, prefetch=1, asynchronous=False, interval=3),
        dict(speculation_stride=3, reverify=False),  # a mismatch regenerates its interval
    ],
    ids=["psa", "paper-os3", "fixed3", "noprefetch", "sync", "s5-i3", "regenerate"],
)
def test_ralmspec_equals_ralmseq(pair, passages, pool, cfg):
    retriever = BagRetriever(passages)
    for text in PROMPTS[:2]:
        prompt = pair.tokenizer.encode(text, add_special_tokens=False)
        seq = _run(
            pair,
            retriever,
            passages,
            RalmConfig(mode="ralmseq", **{k: v for k, v in cfg.items() if k == "interval"}),
            prompt,
        )
        spec = _run(pair, retriever, passages, RalmConfig(**cfg), prompt, pool=pool)
        assert spec.token_ids == seq.token_ids, (text, cfg)
        assert spec.passages == seq.passages  # every interval used the KB's passage
        assert seq.stats.kb_queries == len(seq.passages) == seq.stats.kb_calls
        assert spec.stats.kb_calls <= seq.stats.kb_calls  # a verification covers one interval at least
        if cfg.get("speculation_stride", 0) >= 3 and not spec.stats.mismatches:
            assert spec.stats.kb_calls < seq.stats.kb_calls  # batched: fewer KB calls


def test_top_k_reaches_every_interval(pair, passages, pool):
    """Each interval decodes with the request's sampling params, top-k and min-p included: a top-k
    of 1 samples the greedy output (and without it, this temperature does not)."""
    retriever, prompt = BagRetriever(passages), pair.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    cfg = RalmConfig(speculation_stride=3)
    greedy = _run(pair, retriever, passages, cfg, prompt, pool=pool, method="draft").token_ids
    assert _run(pair, retriever, passages, cfg, prompt, pool=pool, method="draft", temperature=1.5).token_ids != greedy
    one = _run(pair, retriever, passages, cfg, prompt, pool=pool, method="draft", temperature=1.5, top_k=1)
    assert one.token_ids == greedy


@pytest.mark.parametrize("method", ["draft", "llma"])
def test_composes_with_a_draft_and_rolls_back(pair, passages, pool, method):
    """A noisy query stream (many mismatches): rollbacks happen and the output stays RaLMSeq's,
    with speculative decoding between retrievals (the draft, or LLMA copying from the context)."""
    retriever = BagRetriever(passages, dims=8)  # 8 dims: near-random rankings, speculation often wrong
    prompt = pair.tokenizer.encode("printer queue and compiler symbol", add_special_tokens=False)
    seq = _run(pair, retriever, passages, RalmConfig(mode="ralmseq"), prompt, method=method, k=3, max_new=40)
    spec = _run(
        pair, retriever, passages, RalmConfig(speculation_stride=4), prompt, method=method, k=3, pool=pool, max_new=40
    )
    assert spec.token_ids == seq.token_ids
    assert spec.stats.mismatches > 0 and spec.stats.rolled_back_tokens > 0
    # Each mismatch verified its withdrawn interval again under the true passage, in one pass.
    assert 0 < spec.stats.reverify_steps <= spec.stats.mismatches
    assert 0 <= spec.stats.reverified_tokens <= spec.stats.rolled_back_tokens
    redo = _run(
        pair,
        retriever,
        passages,
        RalmConfig(speculation_stride=4, reverify=False),
        prompt,
        method=method,
        k=3,
        pool=pool,
        max_new=40,
    )
    assert redo.token_ids == seq.token_ids and redo.stats.reverify_steps == 0
    target_only = _run(pair, retriever, passages, RalmConfig(mode="ralmseq"), prompt, max_new=40)
    assert target_only.token_ids == seq.token_ids  # the draft between retrievals changes nothing either


def test_async_verification_overlaps_for_real(pair, passages, pool):
    """A KB search of 60 ms runs during the next speculation step: the loop waits less than
    the searches took, measured on the wall clock."""
    slow = BagRetriever(passages, delay_s=0.06)
    prompt = pair.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    res = _run(pair, slow, passages, RalmConfig(speculation_stride=2), prompt, pool=pool, max_new=32)
    t = res.stats.time_s
    assert res.stats.verification_batches >= 2
    assert t["async_overlap"] > 0.0 and t["kb_wait"] < t["kb_search"]
    assert t["async_overlap"] == pytest.approx(t["kb_search"] - t["kb_wait"], abs=0.02)
    sync = _run(pair, slow, passages, RalmConfig(speculation_stride=2, asynchronous=False), prompt, max_new=32)
    assert sync.stats.time_s["async_overlap"] == 0.0 and sync.token_ids == res.token_ids


def test_verification_mode_follows_the_measured_concurrency(pair, passages, pool):
    """``asynchronous = None``: asynchronous while the request decodes alone, synchronous while
    others decode beside it, re-read every round; the output is the same either way."""
    slow = BagRetriever(passages, delay_s=0.02)
    prompt = pair.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    cfg = RalmConfig(speculation_stride=2)
    assert cfg.asynchronous is None
    alone = _run(pair, slow, passages, cfg, prompt, pool=pool, max_new=32, concurrency=lambda: 1)
    busy = _run(pair, slow, passages, cfg, prompt, pool=pool, max_new=32, concurrency=lambda: 4)
    assert alone.stats.async_rounds > 0 and alone.stats.time_s["async_overlap"] > 0.0
    assert busy.stats.async_rounds == 0 and busy.stats.time_s["async_overlap"] == 0.0
    load = iter([1, 1, 3] + [3] * 100)  # others start decoding after two rounds
    mixed = _run(pair, slow, passages, cfg, prompt, pool=pool, max_new=32, concurrency=lambda: next(load))
    assert 0 < mixed.stats.async_rounds < mixed.stats.verification_batches
    assert alone.token_ids == busy.token_ids == mixed.token_ids
    forced = _run(
        pair,
        slow,
        passages,
        RalmConfig(speculation_stride=2, asynchronous=True),
        prompt,
        pool=pool,
        max_new=32,
        concurrency=lambda: 4,
    )
    assert forced.stats.async_rounds > 0  # an explicit choice wins over the measured concurrency
    # a KB whose search holds the interpreter lock (embedded Milvus Lite): synchronous even alone
    slow.search_holds_gil = True
    embedded = _run(pair, slow, passages, cfg, prompt, pool=pool, max_new=32, concurrency=lambda: 1)
    assert embedded.stats.async_rounds == 0 and embedded.token_ids == alone.token_ids
    told = RalmConfig(speculation_stride=2, asynchronous=True)
    assert _run(pair, slow, passages, told, prompt, pool=pool, max_new=32, concurrency=lambda: 1).stats.async_rounds > 0


def test_streams_only_verified_output(pair, passages, pool):
    retriever = BagRetriever(passages, dims=8)
    prompt = pair.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    chunks: list[list[int]] = []
    gen = RalmGenerator(
        SpecEngine(pair),
        retriever,
        lambda ids: [passages[i] for i in ids],
        pair.tokenizer,
        RalmConfig(speculation_stride=3),
        pool=pool,
    )
    res = gen.generate(prompt, SamplingParams(max_new_tokens=30), on_final=chunks.append)
    assert [t for c in chunks for t in c] == res.token_ids  # nothing streamed was later withdrawn


@pytest.mark.parametrize("mode", ["ralmseq", "ralmspec"])
def test_a_stop_ends_the_loop_at_final_output(pair, passages, pool, mode):
    retriever = BagRetriever(passages)
    prompt = pair.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    full = _run(pair, retriever, passages, RalmConfig(mode=mode, speculation_off=False), prompt, pool=pool, max_new=24)
    gen = RalmGenerator(
        SpecEngine(pair),
        retriever,
        lambda ids: [passages[i] for i in ids],
        pair.tokenizer,
        RalmConfig(mode=mode, speculation_off=False),
        pool=pool,
    )
    seen: list[int] = []

    def on_final(tokens):
        seen.extend(tokens)
        return len(seen) >= 8  # a stop sequence showed up

    res = gen.generate(prompt, SamplingParams(max_new_tokens=24), on_final=on_final)
    assert res.finish_reason == "stop" and res.token_ids == seen == full.token_ids[: len(seen)]
    assert 8 <= len(seen) < 24


def test_local_cache_ranks_with_the_kb_score(passages):
    retriever = BagRetriever(passages)
    cache = LocalCache(capacity=8)
    q = retriever.encode([passages[7]])[0]
    ids, _ = retriever.search([q], 8)
    cache.add(ids)
    assert cache.top1(retriever, q) == int(ids[0, 0])
    cache.add(np.arange(20, 40))
    assert len(cache) == 8  # bounded: the oldest went out


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("retrieval.mode", dict(mode="sometimes")),
        ("retrieval.stride", dict(interval=0)),
        ("retrieval.speculation_stride", dict(speculation_stride=99)),
        ("retrieval.prefetch", dict(prefetch=0)),
    ],
)
def test_bad_config_names_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as err:
        RalmConfig(**kwargs)
    assert err.value.param == field


# ------------------------------------------------------------------ OS³
def test_objective_matches_the_paper():
    # synchronous: (1-γ^s)/((1-γ)(sa+b))
    assert objective(3, 0.5, 0.1, 1.0, asynchronous=False) == pytest.approx((1 - 0.125) / (0.5 * 1.3))
    # asynchronous: γ^s((s-1)a + max(a,b)) + (1-γ^s)(sa+b) in the denominator
    den = 0.125 * (2 * 0.1 + 1.0) + 0.875 * 1.3
    assert objective(3, 0.5, 0.1, 1.0, asynchronous=True) == pytest.approx((1 - 0.125) / (0.5 * den))


def test_best_stride_follows_costs():
    assert best_stride(0.0, 0.1, 1.0, asynchronous=False) == 1  # speculation never holds: verify every step
    assert best_stride(0.6, 0.01, 1.0, asynchronous=False) >= 6  # retrieval dominates: long strides
    assert best_stride(0.6, 1.0, 0.01, asynchronous=False) == 1  # generation dominates
    assert best_stride(0.6, 0.2, 0.1, asynchronous=True) == 1  # the paper: async with b < a wants s = 1


def test_scheduler_estimates_gamma_a_b():
    assert StrideScheduler(OS3Config(allow_off=False)).stride() == 1  # the paper's warm-up
    sched = StrideScheduler()
    assert sched.stride() == 0  # ours: the first rounds measure unspeculated
    for stride, matched in [(2, 2), (2, 1), (3, 3), (1, 0), (4, 4), (4, 4)]:  # window 5 keeps the last five
        sched.observe_verification(stride, matched, 0.2 + 0.1 * stride)
    matched = 1 + 3 + 0 + 4 + 4
    assert sched.gamma == pytest.approx(min(0.6, matched / (matched + 2)))
    for _ in range(3):
        sched.observe_speculation(0.05)
    assert sched.a == pytest.approx(0.05)
    assert sched.b(10) == pytest.approx(0.2 + 1.0, rel=1e-6)  # fitted line through (s, 0.2 + 0.1 s)
    assert sched.stride(remaining=2) <= 2
    assert StrideScheduler(fixed=3).stride() == 3


def test_speculation_turns_off_when_ralmseq_is_faster():
    """The rework a mismatch costs (regenerating its interval) is what the paper's objective
    leaves out: with retrieval cheap next to generation, RaLMSeq wins and OS³ says stride 0."""
    a, cheap, dear = 1.0, [0.05] * 16, [1.0] * 16
    assert not speculation_pays(0.6, a, cheap, asynchronous=True)
    assert not speculation_pays(0.9, a, cheap, asynchronous=False)
    assert speculation_pays(0.6, a, dear, asynchronous=True)  # retrieval as dear as generation: overlap pays
    assert speculation_pays(0.9, 0.1, dear, asynchronous=False)  # long strides amortise one dear search
    assert rate_with_rework(2, 0.5, a, 1.0, asynchronous=False) < objective(2, 0.5, a, 1.0, asynchronous=False)
    sched = StrideScheduler(asynchronous=True)
    for _ in range(5):
        sched.observe_verification(1, 0, 0.01)
        sched.observe_speculation(0.5)
    assert sched.stride() == 0 and sched.snapshot()["off_rounds"] == 1
    for _ in range(20):  # the guesses start holding and searches get dear: speculation comes back
        sched.observe_verification(1, 1, 0.6)
    assert sched.stride() >= 1
    kept_on = StrideScheduler(OS3Config(allow_off=False), asynchronous=True)
    for _ in range(5):
        kept_on.observe_verification(1, 0, 0.01)
        kept_on.observe_speculation(0.5)
    assert kept_on.stride() == 1


def test_could_pay_and_no_rework_for_a_loop_that_emits_the_true_token():
    """kNN-LM's off rule: a mismatch costs no rework there, so it ranks by the objective alone;
    and when even the best admitted γ loses to a search per token, guesses stop being scored."""
    a, cheap, dear = 1.0, [0.01] * 16, [0.5] * 16
    for gamma in (0.5, 0.8, 0.95):
        for bs in (cheap, dear):
            if speculation_pays(gamma, a, bs, asynchronous=False):
                assert speculation_pays(gamma, a, bs, asynchronous=False, rework=False)
    # γ 0.7, b = a/2: the objective (no rework) pays, the rate with rework does not
    assert speculation_pays(0.7, a, dear, asynchronous=False, rework=False)
    assert not speculation_pays(0.7, a, dear, asynchronous=False)
    sched = StrideScheduler(OS3Config(gamma_max=0.9, rework=False))
    assert sched.could_pay()  # nothing measured yet
    sched.observe_speculation(a)
    sched.observe_retrieval(1, 0.01)  # a search of a hundredth of a step: no γ ≤ 0.99 can pay
    assert not sched.could_pay() and sched.stride() == 0
    sched.observe_retrieval(1, 0.99)  # searches got dear (b now their mean): worth scoring guesses again
    assert sched.could_pay()
    assert StrideScheduler(OS3Config(allow_off=False)).could_pay() and StrideScheduler(fixed=3).could_pay()


def test_unspeculated_rounds_keep_the_output_and_score_guesses(pair, passages, pool, monkeypatch):
    """Rounds where OS³ turns speculation off (forced here on two rounds of three) retrieve from
    the KB first (the others speculate); the output is RaLMSeq's and the guesses still feed γ."""
    import specops.serving.ralm.loop as loop

    real = loop.StrideScheduler.stride
    seen = []

    def alternate(self, remaining=None):
        s = real(self, remaining)
        seen.append(s)
        return max(1, s) if len(seen) % 3 == 0 else 0

    monkeypatch.setattr(loop.StrideScheduler, "stride", alternate)
    retriever = BagRetriever(passages)
    for text in PROMPTS:
        prompt = pair.tokenizer.encode(text, add_special_tokens=False)
        seq = _run(pair, retriever, passages, RalmConfig(mode="ralmseq"), prompt, max_new=32)
        for asynchronous in (True, False):
            spec = _run(pair, retriever, passages, RalmConfig(asynchronous=asynchronous), prompt, pool=pool, max_new=32)
            assert spec.token_ids == seq.token_ids and spec.passages == seq.passages
            assert spec.stats.unspeculated > 0 and spec.stats.speculations > 0


@pytest.fixture(scope="module")
def real_kb(passages):
    from specops.core.passage import Passage
    from specops.serving.retrieval.kb import build_kb

    docs = [Passage(i, f"doc{i}", text) for i, text in enumerate(passages)]
    return build_kb("loop", docs, embedder="hash", retrievers=("exact", "hnsw", "scann", "bm25"), progress=False)


@pytest.mark.parametrize("kind", ["exact", "hnsw", "scann", "bm25"])
def test_ralmspec_equals_ralmseq_on_every_real_retriever(pair, real_kb, pool, kind):
    """The seam's far side for real: the KB's own retrievers (batch-independent exact scores)."""
    retriever = real_kb.retriever(kind)
    texts = lambda ids: [p.text for p in real_kb.passages(ids)]  # noqa: E731
    for text in PROMPTS[:2]:
        prompt = pair.tokenizer.encode(text, add_special_tokens=False)
        runs = {}
        for name, cfg in (
            ("seq", RalmConfig(mode="ralmseq")),
            ("psa", RalmConfig()),
            ("paper-os3", RalmConfig(speculation_off=False)),
            ("s3", RalmConfig(speculation_stride=3, prefetch=1, asynchronous=False)),
        ):
            gen = RalmGenerator(SpecEngine(pair), retriever, texts, pair.tokenizer, cfg, pool=pool)
            runs[name] = gen.generate(prompt, SamplingParams(max_new_tokens=20))
        assert runs["psa"].token_ids == runs["seq"].token_ids == runs["s3"].token_ids, (kind, text)
        assert runs["psa"].passages == runs["seq"].passages
