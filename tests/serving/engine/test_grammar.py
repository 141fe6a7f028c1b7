"""Structured output under speculation (``specops.serving.engine.grammar``): the grammar masks the target at
every verified row and prunes drafts before verification, so greedy outputs equal target-only's
under the same grammar for every method, sampled ones follow the masked distribution (chi-square,
with a negative control that drops a forbidden sampled draft instead of rejecting it), and what is
logged of a constrained request is what the target saw there."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.errors import InvalidRequestError
from specops.core.index import IndexConfig
from specops.core.models import load_pair
from specops.serving.engine import grammar
from specops.serving.engine.grammar import GrammarSpec
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import DecodeState, Proposals, SamplingParams
from specops.serving.engine.verifier import Verifier
from specops.serving.fleet.stream_logger import RequestMeta, build_records
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import CATALOGUE, ProposerResources
from tests.serving.engine.test_verifier import pooled_chisquare

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."),
    "choice": GrammarSpec.choice(["yes", "no", "not sure"], "guided_choice"),
}
PROMPTS = ["Reply in JSON: who are you?", "The weather today is", "Is this right?"]


@pytest.fixture(scope="module")
def pair(tiny_models):
    """The tiny bootstrap's target (random, with a real tokenizer) and a copy of it as the draft:
    its greedy drafts are the target's unmasked argmax, which the grammar often forbids."""
    p = load_pair(tiny_models / "target", tiny_models / "draft")
    return dataclasses.replace(p, draft=copy.deepcopy(p.target))


@pytest.fixture(scope="module")
def resources(pair):
    engine = SpecEngine(pair)
    prompts = [pair.tokenizer.encode(t) for t in PROMPTS]
    docs = [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=24, grammar=spec), method="target").token_ids
        for p in prompts
        for spec in SPECS.values()
    ]
    store, _ = Datastore.build(pair.target, docs, DatastoreConfig(dims=8, value_len=6, index=IndexConfig("flat")))
    return ProposerResources(pair=pair, datastore=store, references=tuple(tuple(d) for d in docs[:4])), prompts


def _text(pair, ids: list[int]) -> str:
    return pair.tokenizer.decode([t for t in ids if t not in pair.eos_token_ids])


@pytest.mark.parametrize("kind", list(SPECS))
def test_target_only_output_follows_the_grammar(pair, kind):
    engine = SpecEngine(pair)
    for prompt in PROMPTS:
        out = plain_generate(
            engine, pair.tokenizer.encode(prompt), SamplingParams(max_new_tokens=48, grammar=SPECS[kind])
        )
        text = _text(pair, out.token_ids)
        if out.stats.finish_reason == "length":
            continue  # a random model may not close the value in time; what it wrote is a prefix
        if kind in ("json_schema", "json_object"):
            value = json.loads(text)
            assert isinstance(value, dict)
            if kind == "json_schema":
                assert set(value) == {"name", "ok"} and len(value["name"]) <= 6 and isinstance(value["ok"], bool)
        elif kind == "regex":
            assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}\.", text), text
        else:
            choices = ("yes", "no", "not sure")
            assert text in choices
            if any(c != text and c.startswith(text) for c in choices):  # "no": " sure" may follow, or EOS
                assert out.stats.finish_reason in ("stop", "eos"), out.stats.finish_reason
            else:
                assert out.stats.finish_reason == "stop"  # the grammar closed: nothing but EOS could follow


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
@pytest.mark.parametrize("method", [m for m in CATALOGUE if m != "target"])
def test_greedy_outputs_equal_target_only_for_every_method(pair, resources, method, kind):
    res, prompts = resources
    engine = SpecEngine(pair)
    params = SamplingParams(max_new_tokens=32, grammar=SPECS[kind], logprobs=2)
    n = 3 if method in ("dresd", "retrieval") else 0
    for prompt in prompts:
        ref = plain_generate(engine, prompt, params, method="target")
        out = plain_generate(engine, prompt, params, method=method, n_drafts=n, k=4, resources=res)
        assert out.token_ids == ref.token_ids, (method, kind)
        assert out.stats.finish_reason == ref.stats.finish_reason
        for a, b in zip(out.logprobs, ref.logprobs, strict=True):  # raw: of the masked logits, as vLLM's
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_the_twin_draft_speculates_under_the_grammar(pair):
    """Pruning keeps what the grammar allows: a twin draft's tokens are accepted where they are allowed."""
    out = plain_generate(
        SpecEngine(pair),
        pair.tokenizer.encode(PROMPTS[0]),
        SamplingParams(max_new_tokens=32, grammar=SPECS["json_schema"]),
        k=4,
    )
    assert out.stats.num_accepted > 0 and out.stats.num_accepted == out.stats.num_drafted


def test_the_draft_model_drafts_only_what_the_grammar_allows(pair):
    """The draft model masks its own distribution by the grammar: nothing it drafts is pruned, greedy
    or sampled, and a sampled draft's ``q`` (what verification divides by) has no forbidden mass. The
    twin draft's unmasked argmax is forbidden at the first position here, so without the mask the
    row would be cut there."""
    from specops.serving.plan import plain_proposer

    prompt = pair.tokenizer.encode(PROMPTS[0])
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    for params, gen in ((SamplingParams(max_new_tokens=8), None), (sampled, torch.Generator().manual_seed(3))):
        c = _constraint(pair, SPECS["json_schema"])
        with torch.inference_mode():
            first = int(pair.draft(torch.tensor([prompt])).logits[0, -1].argmax())
        assert c._valid([first]) == 0  # what an unmasked twin would draft first
        state = DecodeState(list(prompt), len(prompt), params, generator=gen, grammar=c)
        proposer = plain_proposer(ProposerResources(pair=pair), method="draft")
        proposer.start(state)
        props = proposer.propose(state, 6)
        row = props.rows()[0]
        assert len(row) == 6 and c._valid(row) == 6 and c.prune(props) is props, params
        if props.draft_probs is not None:
            assert float(props.draft_probs[0, 0][~c.allowed([[]])[0]].sum()) == 0.0
        proposer.finish()


def _constraint(pair, spec: GrammarSpec):
    return grammar.for_tokenizer(pair.tokenizer, pair.vocab_size, pair.eos_token_ids).constraint(spec)


def test_prune_cuts_rows_at_the_first_forbidden_token(pair):
    c = _constraint(pair, SPECS["json_schema"])
    ok = pair.tokenizer.encode('{"name": ', add_special_tokens=False)
    bad = pair.tokenizer.encode("}", add_special_tokens=False)
    rows = [ok + bad + ok[:1], ok[:2]]
    props = Proposals.from_rows(rows)
    assert c.prune(props).rows() == [ok, ok[:2]]  # deterministic drafts lose the forbidden token
    sampled = Proposals.from_rows(rows, draft_probs=torch.full((2, len(rows[0]), pair.vocab_size), 1 / pair.vocab_size))
    assert c.prune(sampled).rows() == [ok + bad, ok[:2]]  # a sampled one keeps it, to be rejected
    assert c.num_consumed == 0 and not c.matcher.is_error()  # pruning changed nothing


def test_rows_after_a_forbidden_path_are_unmasked_and_the_matcher_ends_where_it_began(pair):
    c = _constraint(pair, SPECS["choice"])
    yes = pair.tokenizer.encode("yes", add_special_tokens=False)
    first = c.allowed([[]])[0]
    forbidden = int((~first).nonzero()[0])
    allowed = c.allowed([[], yes[:1], [forbidden], [pair.vocab_size + 5]])
    assert allowed[0].equal(first) and first.sum() < pair.vocab_size
    assert allowed[2].all() and allowed[3].all() and not c.matcher.is_error()
    c.commit(yes[:1])
    assert c.num_consumed == 1
    c.truncate(0)
    assert c.num_consumed == 0 and bool(c.allowed([[]])[0].equal(allowed[0]))


def test_bad_grammars_are_400s_naming_the_field(pair):
    g = grammar.for_tokenizer(pair.tokenizer, pair.vocab_size, pair.eos_token_ids)
    for spec in (
        GrammarSpec("regex", "(a|b", "guided_regex"),
        GrammarSpec("json_schema", '{"type": "foo"}', "response_format.json_schema.schema"),
        GrammarSpec("json_schema", "not json", "structured_outputs.json"),
        GrammarSpec("grammar", "start: (", "structured_outputs.grammar"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            g.check(spec)
        assert e.value.param == spec.field
    with pytest.raises(InvalidRequestError):
        GrammarSpec.choice([], "guided_choice")


def _first_tokens(pair, c, prompt, q, trials: int, keep_rejected: bool) -> np.ndarray:
    """The first emitted token of ``trials`` verifications of one draft sampled from ``q``, through
    the real target, verifier and grammar (``keep_rejected=False``: the negative control)."""
    counts = np.zeros(pair.vocab_size, dtype=np.int64)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, grammar=SPECS["choice"])
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=gen))
        props = c.prune(Proposals(tokens=torch.tensor([[d]]), draft_probs=q[None, None]), keep_rejected)
        state = DecodeState(token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params, generator=gen)
        verdict = Verifier(CachedLM(pair.target)).verify(state, props, c)
        counts[verdict.emitted[0]] += 1
    return counts


def test_sampling_follows_the_masked_distribution_with_a_negative_control(pair):
    """A draft that proposes a forbidden token half of the time and an allowed, unlikely one the
    other half: keeping the forbidden one to be rejected (the rule) emits the masked target's
    distribution; dropping it, so the bonus comes from ``p`` rather than the residual, does not."""
    c = _constraint(pair, SPECS["choice"])
    prompt = pair.tokenizer.encode(PROMPTS[2])
    with torch.inference_mode():
        logits = pair.target(torch.tensor([prompt])).logits[0, -1:].float()
    p = warp(c.mask(logits, [[]]), SamplingParams(temperature=1.0))[0].double()
    allowed = (p > 0).nonzero().flatten().tolist()
    assert len(allowed) >= 2, allowed
    unlikely = min(allowed, key=lambda t: float(p[t]))
    forbidden = next(t for t in range(pair.vocab_size) if t not in allowed and t not in pair.eos_token_ids)
    q = torch.zeros(pair.vocab_size)
    q[forbidden], q[unlikely] = 0.5, 0.5
    right = _first_tokens(pair, c, prompt, q, 3000, keep_rejected=True)
    assert pooled_chisquare(right, p.numpy()) > 1e-3
    wrong = _first_tokens(pair, c, prompt, q, 3000, keep_rejected=False)
    assert pooled_chisquare(wrong, p.numpy()) < 1e-6


def test_a_constrained_requests_records_hold_the_masked_distribution(pair):
    """Rejected positions carry the masked logits (what the target could emit there); the top-k
    record holds finite numbers (the forbidden tokens' floor) and validates."""
    engine = SpecEngine(pair, collect_rejections=True)
    prompt = pair.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=32, grammar=SPECS["json_schema"])
    res = ProposerResources(pair=pair, references=((*pair.tokenizer.encode('{"name": "zz", "ok": true}'),),))
    out = plain_generate(engine, prompt, params, method="llma", resources=res, k=4)
    assert out.rejections, "llma copies what the target does not write: some rejections"
    for r in out.rejections:
        assert torch.isinf(r.target_logits).any()  # masked
    miss, _ = build_records(prompt, out, params, RequestMeta("r1", "json"), vocab_size=pair.vocab_size, topk=64)
    miss.validate()
    assert np.isfinite(miss.logprobs).all()
