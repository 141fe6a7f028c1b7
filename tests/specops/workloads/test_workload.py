"""The demo's workloads: the chat schedule's prompts are distinct and disjoint from the
never-served and the router prompts, ``recurring`` draws with replacement, the corpus
workload still builds, the Replayer sends chat requests and reads the speculation block,
and a router fitted on the router prompts routes the served ones to their domain."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from specops.core.models import load_tokenizer, render_chat
from specops.demo.report.data import draft_alpha, draft_share
from specops.demo.run import DemoConfig
from specops.workloads.chat_workload import SYSTEM, messages_of
from specops.workloads.workload import (
    CHAT_PHASES,
    Planned,
    Replayer,
    build_chat_schedule,
    build_workload,
    describe,
    rejected_steps,
)


@pytest.fixture(scope="module")
def tok(tiny_models):
    return load_tokenizer(tiny_models / "target")


@pytest.fixture(scope="module")
def chat(tok):
    return build_chat_schedule(tok, num_requests=60, extra=3, router=20, seed=0)


def test_chat_schedule_is_distinct_and_disjoint_from_unseen_and_router(chat, tok):
    sched = chat.schedule
    assert len(sched) == 60 and [p.index for p in sched] == list(range(60))
    assert all(p.chat and p.token_ids for p in sched)
    ids = [p.token_ids for p in sched]
    assert len(set(ids)) == len(ids), "two requests of the schedule have the same token ids"
    # every request's token ids are its messages rendered as the server renders and tokenizes them
    for p in sched[:5]:
        rendered = render_chat(tok, p.as_messages())
        assert tuple(tok(rendered, add_special_tokens=False)["input_ids"]) == p.token_ids
        assert p.as_messages()[0] == {"role": "system", "content": SYSTEM[p.domain]}
        assert p.as_messages()[1]["content"] == p.text

    assert set(chat.unseen) == set(chat.router_texts) == {"sql", "math", "api"}
    unseen = {tuple(u.token_ids) for us in chat.unseen.values() for u in us}
    assert all(len(us) == 3 for us in chat.unseen.values()) and len(unseen) == 9
    assert not unseen & set(ids), "a never-served prompt is in the schedule"

    router = {t for texts in chat.router_texts.values() for t in texts}
    assert all(len(texts) == 20 for texts in chat.router_texts.values()) and len(router) == 60
    served_texts = {render_chat(tok, p.as_messages()) for p in sched}
    unseen_texts = {render_chat(tok, messages_of(u)) for us in chat.unseen.values() for u in us}
    assert not router & served_texts and not router & unseen_texts
    router_ids = {tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in router}
    assert not router_ids & set(ids) and not router_ids & unseen


def test_chat_schedule_phases_shift_to_api(chat):
    by_phase = Counter((p.phase, p.domain) for p in chat.schedule)
    first, shift = (ph.name for ph in CHAT_PHASES)
    assert sum(n for (ph, _), n in by_phase.items() if ph == first) == 30
    assert by_phase[(shift, "api")] > by_phase[(first, "api")]
    assert by_phase[(first, "sql")] + by_phase[(first, "math")] > by_phase[(shift, "sql")] + by_phase[(shift, "math")]
    assert "sql 45%" in describe(CHAT_PHASES) and "api 70%" in describe(CHAT_PHASES)


def test_chat_schedule_is_seeded_and_keeps_unseen_whatever_the_request_count(chat, tok):
    again = build_chat_schedule(tok, num_requests=60, extra=3, router=20, seed=0)
    assert again.schedule == chat.schedule and again.router_texts == chat.router_texts
    more = build_chat_schedule(tok, num_requests=90, extra=3, router=20, seed=0)
    assert more.unseen == chat.unseen and more.router_texts == chat.router_texts


def test_chat_recurring_draws_with_replacement_from_n_per_domain(tok):
    w = build_chat_schedule(tok, num_requests=40, extra=2, router=5, recurring=3, seed=1)
    distinct = Counter(p.token_ids for p in w.schedule)
    assert len(w.schedule) == 40 and len(distinct) <= 9 and max(distinct.values()) > 1
    per_domain = Counter(p.domain for p in {p.token_ids: p for p in w.schedule}.values())
    assert all(n <= 3 for n in per_domain.values())
    unseen = {tuple(u.token_ids) for us in w.unseen.values() for u in us}
    assert not unseen & set(distinct)


def test_corpus_workload_still_builds(tiny_models, tok):
    w = build_workload("corpus", tiny_models, tok, num_requests=24, prompt_tokens=32, extra=2, seed=0)
    assert w.name == "corpus" and not w.router_texts and len(w.schedule) == 24
    assert {p.domain for p in w.schedule} <= {"code", "prose"} and not any(p.chat for p in w.schedule)
    ids = [p.token_ids for p in w.schedule]
    assert len(set(ids)) == len(ids)
    assert not {tuple(u.token_ids) for us in w.unseen.values() for u in us} & set(ids)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", tiny_models, tok, num_requests=1)


def test_demo_defaults_are_chat_and_leave_the_recipe_to_the_trainer():
    cfg, quick = DemoConfig(), DemoConfig.quick()
    assert cfg.workload == quick.workload == "chat"
    assert quick.requests < cfg.requests and quick.eval_prompts <= cfg.eval_prompts
    for recipe in ("lr", "steps", "replay", "capacity", "positions", "loss", "sampling"):
        assert not hasattr(cfg, recipe), f"the demo should leave {recipe} to the trainer's defaults"


# ---------------------------------------------------------------- the Replayer
class _Fake:
    """Stands in for ``openai.OpenAI().chat.completions`` / ``.completions``: records the call."""

    def __init__(self, spec: dict) -> None:
        self.calls: list[dict] = []
        self.spec = spec

    def create(self, **kw):
        self.calls.append(kw)
        return SimpleNamespace(model_extra={"speculation": self.spec}, usage=SimpleNamespace(completion_tokens=7))


def test_replayer_sends_chat_requests_and_reads_the_speculation_block():
    rep = Replayer("http://127.0.0.1:9/v1", "m", clients=1, max_tokens=12)
    spec = {"cluster": "sql", "drafted": 9, "accepted": 4, "draft_version": "3", "rejected_steps": 2}
    chat_api, comp_api = _Fake(spec), _Fake({**spec, "cluster": "code"})
    rep.client = SimpleNamespace(chat=SimpleNamespace(completions=chat_api), completions=comp_api)
    msgs = (("system", SYSTEM["sql"]), ("user", "How many rows?"))
    out = rep.run(
        [
            Planned(0, "p1", "sql", "How many rows?", messages=msgs, token_ids=(1, 2)),
            Planned(1, "p1", "code", "def f():"),
        ],
        lambda o: None,
    )
    assert [o.error for o in out] == ["", ""]
    (call,) = chat_api.calls
    assert call["messages"] == [
        {"role": "system", "content": SYSTEM["sql"]},
        {"role": "user", "content": "How many rows?"},
    ]
    assert call["max_tokens"] == 12 and call["temperature"] == 0
    assert call["extra_body"] is None and call["model"] == "m"  # no method named: the server's default (auto)
    assert comp_api.calls[0]["prompt"] == "def f():"
    row = out[0].row
    assert (row.cluster, row.domain, row.drafted, row.accepted, row.rejected_steps) == ("sql", "sql", 9, 4, 2)
    assert row.alpha == pytest.approx(4 / 6) and row.acceptance == pytest.approx(4 / 9)
    assert row.draft_version == "3" and row.num_generated == 7 and row.ok


def test_replayer_names_a_method_only_when_asked_and_reads_autos_choices():
    rep = Replayer("http://127.0.0.1:9/v1", "m", clients=1, max_tokens=4, method="draft")
    api = _Fake({"cluster": "sql", "drafted": 3, "accepted": 1, "draft_version": "2", "rejected_steps": 1})
    rep.client = SimpleNamespace(chat=SimpleNamespace(completions=api))
    (o,) = rep.run([Planned(0, "p", "sql", "q", messages=(("user", "q"),))], lambda o: None)
    assert api.calls[0]["extra_body"] == {"speculation": {"method": "draft"}}
    assert o.row.steps is None and o.row.method == "" and o.row.decode_s is None  # a fixed method, an older server

    auto = {
        "method": "auto",
        "cluster": "sql",
        "drafted": 10,
        "accepted": 6,
        "draft_version": "4",
        "rejected_steps": 3,
        "decode_s": 0.5,
        "auto": {
            "methods": {
                "draft": {"steps": 3, "drafted": 8, "accepted": 5, "rejected_steps": 2},
                "llma": {"steps": 1, "drafted": 2, "accepted": 1, "rejected_steps": 1},
                "target": {"steps": 4, "drafted": 0, "accepted": 0, "rejected_steps": 0},
            }
        },
    }
    rep = Replayer("http://127.0.0.1:9/v1", "m", clients=1, max_tokens=4)
    api = _Fake(auto)
    rep.client = SimpleNamespace(chat=SimpleNamespace(completions=api))
    (o,) = rep.run([Planned(0, "p", "sql", "q", messages=(("user", "q"),))], lambda o: None)
    r = o.row
    assert api.calls[0]["extra_body"] is None
    assert (r.method, r.steps, r.draft_steps, r.draft_accepted, r.draft_rejected_steps) == ("auto", 8, 3, 5, 2)
    assert r.tokens_per_s == pytest.approx(7 / 0.5)
    assert draft_share([r]) == pytest.approx(3 / 8) and draft_alpha([r]) == pytest.approx(5 / 7)
    none_drafted = {**auto, "draft_version": None, "auto": {"methods": {"target": {"steps": 5}}}}
    rep.client = SimpleNamespace(chat=SimpleNamespace(completions=_Fake(none_drafted)))
    (o,) = rep.run([Planned(0, "p", "sql", "q", messages=(("user", "q"),))], lambda o: None)
    assert o.row.draft_version == "" and draft_share([o.row]) == 0.0 and draft_alpha([o.row]) is None


def test_rejected_steps_is_read_defensively():
    assert rejected_steps({"rejected_steps": 3}) == 3
    assert rejected_steps({"num_rejected_steps": 0}) == 0
    assert rejected_steps({}) is None and rejected_steps({"rejected_steps": None}) is None
    rep = Replayer("http://127.0.0.1:9/v1", "m", clients=1, max_tokens=4)
    api = _Fake({"cluster": "api", "drafted": 3, "accepted": 1, "draft_version": "base"})  # an older server
    rep.client = SimpleNamespace(chat=SimpleNamespace(completions=api))
    (o,) = rep.run([Planned(0, "p", "api", "q", messages=(("user", "q"),))], lambda o: None)
    assert o.row.ok and o.row.rejected_steps is None and o.row.acceptance == pytest.approx(1 / 3)


# ---------------------------------------------------------------- the first router
def test_router_fitted_on_router_prompts_routes_served_ones_to_their_domain(chat, tok):
    from specops.core.embed import MiniLMEmbedder
    from specops.trainer.router_fit import fit_router

    router = fit_router(chat.router_texts, MiniLMEmbedder(), seed=0, refine=False)
    assert set(router.clusters) == {"sql", "math", "api"}
    probe = [p for d in ("sql", "math", "api") for p in [q for q in chat.schedule if q.domain == d][:4]]
    got = [d.cluster for d in router.route_batch([render_chat(tok, p.as_messages()) for p in probe])]
    assert got == [p.domain for p in probe]
