"""``specops serve --engine vllm``: our front door over real vLLM CPU servers.

One front door for the module (real vLLM servers in the vLLM venv, tiny bootstrapped pair,
MLflow on SQLite, the local stream log), running a server per method: the draft model, vLLM's
n-gram lookup, our copy proposer (LLMA with references) and target-only. It checks the round
trip of every method (greedy output identical to our own engine's target-only decode,
streaming passes through), per-request counts (vLLM's own, and the front door's
recomputation agreeing with them), ``auto`` choosing a server per request, copying from
references, what is refused with a 400, the records logged for the trainer, a
teacher-forward update on them, and hot-swaps to promoted drafts (loaded into the standby
server, then into that server in place) with no failed request while requests keep coming.

Skips, saying why, where the vLLM venv is absent (``make test`` creates it: ``make vllm-venv``).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import openai
import pytest
import requests

from specops.core.models import has_weights, load_model_dir, load_tokenizer, tokenizer_hash
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.vllm.plugin.specops_vllm_copy import join_refs
from specops.serving.vllm.process import VLLMError, vllm_python
from specops.streams import StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord, MissRecord
from tests.serving.http.api_support import MODEL, assert_error, running, serve_config, wait_until

try:
    vllm_python()
    NO_VLLM = ""
except VLLMError as exc:
    NO_VLLM = str(exc)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(NO_VLLM), reason=NO_VLLM or "vLLM venv present")]

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n", "SELECT name FROM"]
MAX_TOKENS = 12


def _with_own_vocab(models: Path, reference) -> Path:
    """The tiny pair, its draft scoring part of its vocabulary (``draft_vocab.json``, as the default
    draft does): vLLM then loads our model class over a view of it (``serving/vllm/vocab.py``). The
    subset holds the prompts' and the target's output tokens and the lower half of the ids."""
    from specops.core import draft_vocab

    out, tok = reference
    ids = set(range(256))
    for p, output in out.items():
        ids |= {*tok(p, add_special_tokens=False)["input_ids"], *output}
    size = load_model_dir(models).vocab_size
    draft_vocab.save(models / "draft", draft_vocab.DraftVocab(sorted(ids), size), source="the vLLM tests")
    # a chat template (the tiny tokenizer has none, and vLLM serves no chat without one): both engines render with it
    (models / "target" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return models


@pytest.fixture(scope="module")
def world(tiny_models, reference, tmp_path_factory):
    # A swap starts a second vLLM server beside a busy one. vLLM pins each server's worker to the
    # same cores ("auto"); on 2 cores the new one then waits for the busy one: let the OS place them.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Each server's model runs inside its engine-core process (with "--distributed-executor-backend uni"
    # below): two processes a server instead of three, one torch+vLLM import less per start (a third
    # of a start's CPU, five starts and a restart here); vLLM allows uni on a CPU only with this set.
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    root = tmp_path_factory.mktemp("vllm")
    models = _with_own_vocab(Path(shutil.copytree(tiny_models, root / "models")), reference)
    db = root / "registry" / "mlflow.db"
    db.parent.mkdir(parents=True)
    registry_uri = f"sqlite:///{db}"
    stream_url = f"local://{root}/streams"
    cfg = serve_config(
        models,
        engine="vllm",
        stream=stream_url,
        registry=registry_uri,
        poll_s=0.5,
        vllm_max_model_len=512,  # room for a tool list (the tiny tokenizer spends a token on two characters)
        vllm_kv_cache_gb=1,
        # --enforce-eager: no torch.compile warm-up (minutes on 2 cores): the tests check behaviour, not speed.
        # 64 KV blocks of 128 tokens (4x what 4 requests of 512 tokens take) instead of the 1 GiB that
        # VLLM_CPU_KVCACHE_SPACE allows at least (a million tokens, allocated at each start: 12 s, now 0.1 s)
        vllm_args="--enforce-eager --distributed-executor-backend uni --num-gpu-blocks-override 64",
        vllm_speculation="draft,ngram,copy,none",
        vllm_standby=1,  # a draft server started ahead with the base draft: the first champion loads into it
        session_cache_tokens=0,  # copy sources are the request's own (the recount below rebuilds them)
        max_concurrency=4,
        clusters="code",
        route_tenants="",
    )
    with running(cfg, root, ready=False) as srv:
        srv.wait_ready(600)  # the base draft's vLLM server starts first
        yield {"srv": srv, "root": root, "registry": registry_uri, "stream": stream_url, "models": models}
    mp.undo()


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Our own engine's greedy target-only output of each prompt (token ids)."""
    pair = load_model_dir(tiny_models)
    engine, tok = SpecEngine(pair), pair.tokenizer
    out = {}
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        out[p] = plain_generate(engine, ids, SamplingParams(max_new_tokens=MAX_TOKENS), method="target").token_ids
    return out, tok


def _complete(url: str, prompt: str, **extra) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | extra
    return requests.post(url + "/v1/completions", json=body, timeout=120)


def test_every_method_round_trips_the_targets_greedy_output_with_its_own_counts(world, reference):
    srv = world["srv"]
    ref, tok = reference
    # the front door holds the models' configs, not their weights (vLLM does)
    assert not has_weights(srv.state.pair.target) and not has_weights(srv.state.pair.draft)
    # the draft server scores the draft's own vocabulary: vLLM resolved our model class for the drafter
    assert "Resolved architecture: SpecopsDraftVocabLlamaForCausalLM" in srv.state.follower.base_backend.log_tail(10**6)
    for method in ("draft", "pld", "llma", "target"):
        for p in PROMPTS:
            r = _complete(srv.url, p, speculation={"method": method}, return_token_ids=True)
            assert r.status_code == 200, r.text
            body = r.json()
            choice, sp = body["choices"][0], body["speculation"]
            assert choice["token_ids"] == ref[p], (method, p)  # compared by ids, not only by text
            assert choice["text"] == tok.decode(ref[p], skip_special_tokens=True)
            assert choice["prompt_token_ids"] == tok(p, add_special_tokens=False)["input_ids"]
            assert sp["engine"] == "vllm" and sp["method"] == method
            if method == "target":
                assert sp["alpha_token"] is None and sp["drafted"] is None  # nothing drafted, no α
                continue
            # vLLM's own per-request counts (--per-request-spec-decode-metrics)
            assert sp["counts_source"] == "vllm" and sp["drafted"] >= sp["accepted"] >= 0
            assert 0.0 <= sp["alpha_token"] <= 1.0
            assert sp["draft_version"] == ("base" if method == "draft" else None)
    # streaming passes through, chunk by chunk, to the same text
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(ref[PROMPTS[0]], skip_special_tokens=True)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    # echo puts the prompt first; ignore_eos runs to max_tokens (vLLM's own flag)
    echoed = _complete(srv.url, PROMPTS[0], echo=True).json()["choices"][0]["text"]
    assert echoed == PROMPTS[0] + tok.decode(ref[PROMPTS[0]], skip_special_tokens=True)
    run = _complete(srv.url, PROMPTS[0], ignore_eos=True, speculation={"method": "draft"}).json()
    assert run["usage"]["completion_tokens"] == MAX_TOKENS
    # n choices: a request per choice to the server, sent together
    body = _complete(srv.url, PROMPTS[1], n=2, speculation={"method": "pld"}, return_token_ids=True).json()
    assert [c["token_ids"] for c in body["choices"]] == [ref[PROMPTS[1]]] * 2
    assert [c["index"] for c in body["speculation"]["choices"]] == [0, 1]


def test_the_front_doors_recount_agrees_with_vllms_own(world, reference):
    """vLLM's per-request counts against the front door's recomputation from the output (what a
    stream closed early gets): equal but for the last step, whose drafts past ``max_tokens`` vLLM
    still verifies and counts."""
    srv, (ref, tok) = world["srv"], reference
    node = srv.state.node
    refs_text = tok.decode(ref[PROMPTS[1]][2:])
    for method in ("draft", "pld", "llma"):
        for p in PROMPTS:
            extra = {"references": [refs_text]} if method == "llma" else {}
            body = _complete(srv.url, p, speculation={"method": method}, return_token_ids=True, **extra).json()
            sp, ids = body["speculation"], body["choices"][0]["token_ids"]
            prompt = body["choices"][0]["prompt_token_ids"]
            sources = join_refs([tok(refs_text, add_special_tokens=False)["input_ids"]]) if method == "llma" else []
            mine = node._replay(method, None, prompt, ids, sources, 1)
            assert sp["counts_source"] == "vllm"
            assert 0 <= sp["drafted"] - mine.drafted <= node.k, (method, p, sp, mine)
            assert 0 <= sp["accepted"] - mine.accepted <= node.k, (method, p, sp, mine)
            assert abs(sp["rejected_steps"] - mine.rejected_steps) <= 1, (method, p, sp, mine)
    # a stop sequence closes the stream early: no final chunk from vLLM, the counts are recomputed
    text = tok.decode(ref[PROMPTS[0]], skip_special_tokens=True)
    stop = text[len(text) // 2 :][:3]
    if stop.strip():
        sp = _complete(srv.url, PROMPTS[0], speculation={"method": "pld"}, stop=[stop]).json()["speculation"]
        assert sp["counts_source"] in ("replay", "vllm") and sp["alpha_token"] is not None


def test_auto_chooses_a_server_per_request_and_copies_references(world, reference):
    srv, (ref, tok) = world["srv"], reference
    seen = set()
    for i in range(12):  # every server is tried first (MIN_TRIALS each), then the estimates decide
        r = _complete(srv.url, PROMPTS[i % len(PROMPTS)], cluster="code")
        assert r.status_code == 200, r.text
        sp = r.json()["speculation"]
        assert r.json()["choices"][0]["text"] == tok.decode(ref[PROMPTS[i % len(PROMPTS)]], skip_special_tokens=True)
        seen.add(sp["method"])
        assert sp["auto"]["level"] == "request" and sp["auto"]["last"]["chose"] == sp["method"]
    assert seen == {"draft", "pld", "llma", "target"}
    # LLMA through vLLM: a reference holding the continuation is copied (and the output is the target's)
    p = PROMPTS[2]
    body = _complete(
        srv.url, p, speculation={"method": "llma"}, references=[p + tok.decode(ref[p])], return_token_ids=True
    ).json()
    assert body["choices"][0]["token_ids"] == ref[p]
    assert body["speculation"]["alpha_token"] >= 0.5, body["speculation"]


def test_logprobs_come_back_from_every_server_as_our_engines(world, reference, tiny_models):
    """vLLM's per-token log-probabilities (read back by token id) under every server equal our own
    engine's target-only ones, token by token, streamed and not."""
    srv, (ref, tok) = world["srv"], reference
    pair = load_model_dir(tiny_models)
    p = PROMPTS[0]
    ids = tok(p, add_special_tokens=False)["input_ids"]
    ours = plain_generate(SpecEngine(pair), ids, SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=3), method="target")
    for method in ("draft", "pld", "llma", "target"):
        choice = _complete(srv.url, p, logprobs=3, return_token_ids=True, speculation={"method": method}).json()
        choice = choice["choices"][0]
        assert choice["token_ids"] == ref[p] == ours.token_ids, method
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ours.logprobs), method
        for got, top, want in zip(lp["token_logprobs"], lp["top_logprobs"], ours.logprobs, strict=True):
            assert got == pytest.approx(want.logprob, abs=1e-3), method
            # keyed by token text: two tokens that decode alike keep one entry
            alts = [v for _, v in want.top]
            assert max(top.values()) == pytest.approx(alts[0], abs=1e-3), method
            assert all(any(abs(v - a) < 1e-3 for a in alts) for v in top.values()), method
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    chunks = client.completions.create(
        model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=1
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([x.logprob for x in ours.logprobs], abs=1e-3)
    # echo with logprobs scores the prompt too: vLLM's prompt log-probabilities, read back, equal our engine's
    scored = SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=3)
    ours = plain_generate(SpecEngine(pair), ids, scored, method="target")
    for method in ("draft", "target"):
        choice = _complete(srv.url, p, echo=True, logprobs=3, speculation={"method": method}).json()["choices"][0]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, method  # nothing predicts it
        want = [x.logprob for x in ours.prompt_logprobs + ours.logprobs]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3), method
        # top_logprobs is keyed by token text: two tokens that decode alike keep one entry
        for top, x in zip(lp["top_logprobs"][1:], ours.prompt_logprobs + ours.logprobs, strict=True):
            alts = [v for _, v in x.top]
            assert max(top.values()) == pytest.approx(alts[0], abs=1e-3), method
            assert all(any(abs(v - a) < 1e-3 for a in alts) for v in top.values()), method


def test_what_vllm_cannot_do_is_a_400_naming_the_field(world):
    url = world["srv"].url
    assert_error(_complete(url, "x", speculation={"method": "dresd"}), 400, "invalid_request", "speculation.method")
    assert_error(_complete(url, "x", speculation={"k": 7}), 400, "invalid_request", "speculation.k")
    assert _complete(url, "x", speculation={"method": "draft", "k": 3}).status_code == 200
    # vLLM refuses min_p with speculative decoding, and its CPU engine core fails on top_k then: we say so
    # first, naming the field; greedy requests (where neither changes anything) go through, and auto
    # sends a sampled request with them to the target-only server
    draft = {"method": "draft"}
    assert_error(_complete(url, "x", temperature=1.0, min_p=0.1, speculation=draft), 400, "invalid_request", "min_p")
    assert_error(_complete(url, "x", temperature=1.0, top_k=5, speculation=draft), 400, "invalid_request", "top_k")
    assert _complete(url, "x", temperature=0, top_k=5, speculation=draft).status_code == 200
    r = _complete(url, "x", temperature=1.0, top_k=5, seed=1)
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "target", r.text
    # penalties and biases: the target-only server applies them (auto sends the request there), with
    # vLLM's definitions, which are ours: the same greedy output as our engine's
    adjust = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_tokens": 6}
    assert_error(_complete(url, "x", speculation=draft, **adjust), 400, "invalid_request", "min_tokens")
    r = _complete(url, PROMPTS[0], return_token_ids=True, **adjust)
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "target", r.text
    models = world["models"]
    pair = load_model_dir(models)
    ids = pair.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    ours = plain_generate(SpecEngine(pair), ids, SamplingParams(max_new_tokens=MAX_TOKENS, **adjust), method="target")
    assert r.json()["choices"][0]["token_ids"] == ours.token_ids
    # the servers report raw log-probabilities (vLLM sets the kind once per server)
    processed = {"logprobs": 1, "logprobs_mode": "processed_logprobs"}
    assert_error(_complete(url, "x", **processed), 400, "invalid_request", "logprobs_mode")
    # a max_tokens past what the servers' --max-model-len leaves is clamped to it, as our engine stops
    # at its context: finish "length", not vLLM's 400 about a limit the client cannot see
    r = _complete(url, [5] * 500, max_tokens=64, ignore_eos=True, return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 512 - 500


GRAMMARS = [
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "w",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 4}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        }
    },
    {"guided_regex": "[a-z]{2,5}( [a-z]{2,5}){2}"},
    {"structured_outputs": {"choice": ["sunny", "rainy", "grey skies"]}},
]


@pytest.mark.parametrize("field", GRAMMARS, ids=["json_schema", "regex", "choice"])
def test_grammars_run_on_the_target_server_as_our_engine_decodes_them(world, field):
    """A constrained request goes to the target-only server (``auto`` sends it there; a drafting
    server named is a 400), whose llguidance backend decodes under the grammar our engine does:
    the same greedy output, ids and text."""
    from specops.serving.http.schema import CompletionRequest

    url, pair = world["srv"].url, load_model_dir(world["models"])
    spec = CompletionRequest(model=MODEL, prompt="x", **field).grammar()
    assert_error(_complete(url, "x", speculation={"method": "draft"}, **field), 400, "invalid_request", spec.field)
    r = _complete(url, PROMPTS[1], return_token_ids=True, max_tokens=24, **field)
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "target", r.text
    ids = pair.tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    ours = plain_generate(SpecEngine(pair), ids, SamplingParams(max_new_tokens=24, grammar=spec), method="target")
    got = [t for t in r.json()["choices"][0]["token_ids"] if t not in pair.eos_token_ids]
    assert got == [t for t in ours.token_ids if t not in pair.eos_token_ids]


def test_a_named_tool_is_called_through_the_target_server(world):
    """The front door renders the tools and parses the call; the grammar of a named function goes
    to the target-only server, and the arguments follow the function's schema."""
    fn = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
        },
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": [fn],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    r = requests.post(world["srv"].url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "target", r.text
    long = {**body, "messages": [{"role": "user", "content": "word " * 600}]}  # past --max-model-len: the client's 413
    assert_error(
        requests.post(world["srv"].url + "/v1/chat/completions", json=long, timeout=60),
        413,
        "prompt_too_long",
        "messages",
    )
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] in ("c", "f")


CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}\n\n{% endfor %}"
"""The tiny tokenizer has no chat template: the module's copy of the models gets this one, which
both our front door and vLLM render chats with."""
OUR_EXTENSIONS = {"speculation"}
"""Fields only our responses carry (``docs/api.md``)."""
VLLM_EXTRAS = {
    "system_fingerprint",
    "service_tier",
    "prompt_logprobs",
    "kv_transfer_params",
    "stop_reason",
    "reasoning_content",
    "reasoning",
    "annotations",
    "audio",
    "function_call",
    "prompt_token_ids",
    "token_ids",
    "prompt_tokens_details",
    "completion_tokens_details",
    "routed_experts",
    "ec_transfer_params",
    "metrics",
    "prompt_text",
    "refusal",  # OpenAI's: vLLM puts it in the message, we in chat logprobs (both as OpenAI documents, always null)
}
"""vLLM's own additions to OpenAI's shapes (null or absent in what OpenAI documents)."""


def _shape_diff(ours, theirs, path: str = "") -> list[str]:
    """Where two responses' shapes differ: a key one has and the other lacks, or a value of another
    JSON type (null matches anything: a field may be empty; lists compare their first items)."""
    if ours is None or theirs is None:
        return []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if path.endswith("top_logprobs[0]"):  # keyed by token text: data, not shape (near-tied alternatives
            return []  # of a random model may differ by CPU); its values' type is checked by the chat shape
        out = []
        for k in sorted(set(ours) | set(theirs)):
            if k in OUR_EXTENSIONS or k in VLLM_EXTRAS:
                continue
            if k not in ours or k not in theirs:
                out.append(f"{path}.{k}: only in {'ours' if k in ours else 'vLLM'}")
            else:
                out += _shape_diff(ours[k], theirs[k], f"{path}.{k}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        return _shape_diff(ours[0], theirs[0], f"{path}[0]") if ours and theirs else []
    kind = lambda v: "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__  # noqa: E731
    return [] if kind(ours) == kind(theirs) else [f"{path}: {kind(ours)} here, {kind(theirs)} in vLLM"]


def _raw_target_server(world) -> str:
    """The URL of the front door's target-only vLLM server (its log file's name holds its port)."""
    servers = requests.get(world["srv"].url + "/v1/clusters", timeout=30).json()["vllm"]["servers"]
    name = next(s["name"] for s in servers if s["speculation"] == "none")
    log = next(world["root"].rglob(f"vllm-{name}-*.log"))
    return f"http://127.0.0.1:{log.stem.rsplit('-', 1)[1]}"


def test_responses_have_vllms_shapes(world):
    """The compatibility suite's calls against a raw vLLM server and against ours: every field
    either names, field by field, has the same JSON type (ids, timings and each side's own
    extensions aside), through the official client too."""
    ours = world["srv"].url
    raw = _raw_target_server(world)
    raw_model = requests.get(raw + "/v1/models", timeout=30).json()["data"][0]["id"]
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    # (tools are not compared: vLLM 0.32 refuses even a named tool_choice without --tool-call-parser)
    base = {"max_tokens": 12, "temperature": 0}
    calls = [
        ("/v1/completions", {"prompt": "def add(a, b):"}),
        ("/v1/completions", {"prompt": "def add(a, b):", "logprobs": 2}),
        ("/v1/completions", {"prompt": "def add(a, b):", "n": 2, "temperature": 1.0, "seed": 3}),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 1.0, "logit_bias": {"5": 2.0}, "min_tokens": 4}),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            },
        ),
    ]
    diffs = []
    for path, body in calls:
        mine = requests.post(ours + path, json={"model": MODEL, **base, **body}, timeout=120)
        theirs = requests.post(raw + path, json={"model": raw_model, **base, **body}, timeout=120)
        assert mine.status_code == theirs.status_code == 200, (path, body, mine.text, theirs.text)
        diffs += [f"{path} {sorted(body)}: {d}" for d in _shape_diff(mine.json(), theirs.json())]
    assert not diffs, "\n".join(diffs)


def test_every_request_is_logged_for_teacher_forward_training(world, tmp_path):
    srv = world["srv"]
    ids = []
    for i in range(4):
        r = _complete(srv.url, f"{PROMPTS[i % len(PROMPTS)]} {i}", cluster="code", speculation={"method": "draft"})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"].removeprefix("cmpl-"))
    assert srv.state.logger.flush(20)
    cfg = StreamConfig(url=world["stream"])
    with open_stream(cfg) as s:
        misses = {m.request_id: m for m in (codec.decode(x.value) for x in s.read(cfg.topics.misses))}
        gens = {g.request_id: g for g in (codec.decode(x.value) for x in s.read(cfg.topics.generations))}
    for rid in ids:
        miss, gen = misses[rid], gens[rid]
        assert isinstance(miss, MissRecord) and isinstance(gen, GenerationRecord)
        assert miss.engine == "vllm" and miss.num_rejected == 0 and not miss.scored
        assert gen.cluster == miss.cluster == "code" and gen.draft_version == "base"
        assert list(miss.token_ids) == [*gen.prompt_ids, *gen.output_ids] and len(gen.output_ids) >= 1

    # the trainer learns from them by a teacher forward of the target (no logged distributions)
    from specops.trainer.online.config import OnlineConfig
    from specops.trainer.online.trainer import OnlineTrainer

    models = world["models"]
    trainer = OnlineTrainer(
        StreamConfig(url=world["stream"]),
        models / "draft",
        tmp_path / "trainer",
        OnlineConfig(interval=2, holdout_every=1000, group="vllm-test"),
        target=models / "target",
    )
    try:
        trainer.run(max_idle_s=2.0)
        st = trainer.state("code")
        assert st.positions_trained > 0, "the update trained on the recomputed target distributions"
    finally:
        trainer.close()


def _zero_head(draft: Path) -> None:
    """Zero a draft's embeddings and LM head in place: it then proposes token 0 at every step,
    which the target almost never takes (α near 0, where the bootstrap draft's is high)."""
    from safetensors.torch import load_file, save_file

    for f in draft.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v.zero_() if ("lm_head" in k or "embed" in k) else v for k, v in weights.items()}, f)


def test_promoted_drafts_load_into_running_servers_with_no_failed_request(world, tmp_path):
    """A cluster's first champion loads into the standby server; its next one reloads that server
    in place: no server starts during either swap, no request fails, and the draft each request
    then drafts with is the promoted one (a draft that proposes nothing acceptable shows it)."""
    srv, models = world["srv"], world["models"]
    vllm = srv.state.vllm
    bad, good = tmp_path / "bad", tmp_path / "good"
    shutil.copytree(models / "draft", bad)
    shutil.copytree(models / "draft", good)
    _zero_head(bad)
    reg = RegistryStore(RegistryConfig(uri=world["registry"]))
    failures, served, stop = [], [], threading.Event()

    def load() -> None:  # requests keep coming through the swaps
        i = 0
        while not stop.is_set():
            r = _complete(srv.url, f"{PROMPTS[i % len(PROMPTS)]}", cluster="code", speculation={"method": "draft"})
            (served if r.status_code == 200 else failures).append(r)
            i += 1
            stop.wait(0.2)

    def on(version: str) -> list[dict]:
        return [r.json()["speculation"] for r in list(served) if r.json()["speculation"]["draft_version"] == version]

    assert wait_until(lambda: vllm.standbys(), 600, 0.5), "the standby server started after readiness"
    # the standby taken is replaced in the background (tests/serving/vllm/test_vllm_units.py checks that without
    # a process); here it would be a sixth vLLM server on a 2-core machine for the rest of the module
    vllm.standby = 0

    def starts() -> list[str]:  # servers started (a standby's start included), not drafts loaded into one
        return [h["name"] for h in vllm.history if "how" not in h]

    before = starts()
    threads = [threading.Thread(target=load) for _ in range(2)]  # two clients at all times
    for t in threads:
        t.start()
    versions = []
    try:
        follower = srv.state.follower
        for draft in (bad, good):
            dv = reg.artifact("draft").register("code", draft, tokenizer_sha256=tokenizer_hash(load_tokenizer(draft)))
            reg.artifact("draft").promote("code", dv.version, reason="test")
            versions.append(dv.version)
            assert wait_until(lambda: follower.serving_version("code") == dv.version, 120, 0.1), follower.swaps
            assert wait_until(lambda: len(on(dv.version)) >= 3, 120, 0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, [(r.status_code, r.text[:200]) for r in failures[:3]]
    texts = {r.json()["choices"][0]["text"] for r in served if r.json()["speculation"]["cluster"] == "code"}
    assert len(texts) <= len(PROMPTS)  # greedy: one output per prompt whichever draft served it
    reloads = [(h["name"], h["how"], h["vocab"]) for h in vllm.history if "how" in h]
    # both drafts score their own vocabulary in vLLM (draft_vocab.json), read again at each load
    size = len(json.loads((good / "draft_vocab.json").read_text())["token_ids"])
    want = [(f"code-v{versions[0]}", "standby", size), (f"code-v{versions[1]}", "in place", size)]
    assert reloads == want, vllm.history
    assert starts() == before, "no server started for either swap"
    # the zeroed draft drafted the requests that started on it, the good one those after it
    bad_alpha = sorted(sp["alpha_token"] for sp in on(versions[0]))
    good_alpha = sorted(sp["alpha_token"] for sp in on(versions[1]))
    assert bad_alpha[len(bad_alpha) // 2] < 0.2 < good_alpha[len(good_alpha) // 2], (bad_alpha, good_alpha)
    live = {s.name for s in vllm.servers()}
    assert f"code-v{versions[1]}" in live and "base" in live and f"code-v{versions[0]}" not in live, live


def test_a_vllm_server_that_dies_is_restarted_and_requests_meanwhile_get_503(world):
    import os
    import signal

    srv = world["srv"]
    base = srv.state.follower.base_backend
    os.killpg(base.proc.pid, signal.SIGKILL)  # the engine dies (as vLLM exits when a step outlives its timeout)
    base.proc.wait(30)
    r = _complete(srv.url, PROMPTS[0])  # the default cluster serves the base draft
    if r.status_code != 200:  # refused while it restarts: a 503 to retry, never a 500
        assert_error(r, 503, "unavailable")
        assert r.headers.get("Retry-After")
    assert wait_until(lambda: base.alive() and not base.restarting and base.restarts == 1, 600, 0.5)
    assert _complete(srv.url, PROMPTS[0]).status_code == 200
