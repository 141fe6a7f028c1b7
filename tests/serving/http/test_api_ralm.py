"""Retrieval-augmented requests through the HTTP API: a knowledge base of --kb-dirs serves
`retrieval` requests on completions and chat, RaLMSpec answers exactly as RaLMSeq, the
response names the passages and the loop's numbers, metrics count per retriever, and bad
input gets a 400 naming the field."""

from __future__ import annotations

import pytest
import requests

from specops.core.passage import Passage
from specops.serving.retrieval.kb import build_kb
from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config

TEXTS = {
    "ls(1)": "ls lists directory contents. With -l it shows permissions, owners, sizes and times of each file.",
    "cp(1)": "cp copies files and directories. With -r it copies directories recursively, keeping the tree.",
    "tar(1)": "tar stores many files in one archive and extracts them again; -z compresses with gzip.",
    "ssh(1)": "ssh logs into a remote machine over an encrypted channel and runs commands there.",
    "grep(1)": "grep prints lines that match a pattern; -i ignores case and -r searches directories.",
    "cron(8)": "cron runs scheduled commands at the times written in each user's crontab file.",
}


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory):
    passages = [Passage(i, title, text, source=f"/man/{title}") for i, (title, text) in enumerate(TEXTS.items())]
    kb = build_kb("tools", passages, embedder="hash", retrievers=("exact", "bm25"), progress=False)
    return kb.save(tmp_path_factory.mktemp("kb") / "tools")


def _post(srv, path="/v1/completions", **body):
    return requests.post(f"{srv.url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def test_retrieval_requests_and_errors(tiny_models, kb_dir, tmp_path):
    with running(serve_config(tiny_models, kb_dirs=[str(kb_dir)]), tmp_path / "srv") as srv:
        m0 = requests.get(f"{srv.url}/metrics", timeout=30).text  # counters are per process: other tests count too
        prompt = "Question: how do I copy a directory with all its files?\nAnswer:"
        for retriever in ("exact", "bm25"):
            bodies = {}
            for mode in ("ralmseq", "ralmspec"):
                r = _post(
                    srv,
                    prompt=prompt,
                    max_tokens=16,
                    speculation={"method": "draft", "k": 3},
                    retrieval={"kb": "tools", "mode": mode, "retriever": retriever, "stride": 4},
                )
                assert r.status_code == 200, r.text
                bodies[mode] = r.json()
            seq, spec = bodies["ralmseq"], bodies["ralmspec"]
            assert spec["choices"][0]["text"] == seq["choices"][0]["text"]  # same output, per retriever
            ret = spec["retrieval"]
            assert ret["kb"] == "tools" and ret["kb_version"] == "local" and ret["retriever"] == retriever
            assert ret["interval_passages"] == seq["retrieval"]["interval_passages"]
            titles = {p["title"] for p in ret["passages"]}
            assert titles and titles <= set(TEXTS)
            assert seq["retrieval"]["kb_queries"] == len(seq["retrieval"]["interval_passages"]) == 4
            assert ret["mode"] == "ralmspec" and ret["kb_calls"] >= 1 and "async_overlap" in ret["time_s"]
            assert spec["usage"]["completion_tokens"] == 16 and spec["speculation"]["kb_version"] == "local"
        chat = _post(
            srv,
            "/v1/chat/completions",
            messages=[{"role": "user", "content": "what does grep do?"}],
            max_tokens=8,
            retrieval={"kb": "tools", "retriever": "bm25"},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["retrieval"]["passages"]
        streamed = requests.post(
            f"{srv.url}/v1/completions",
            json={
                "model": MODEL,
                "temperature": 0,
                "prompt": prompt,
                "max_tokens": 16,
                "stream": True,
                "retrieval": {"kb": "tools", "speculation_stride": 2},
            },
            timeout=120,
            stream=True,
        )
        text = "".join(line for line in streamed.iter_lines(decode_unicode=True) if line)
        assert "[DONE]" in text
        m = requests.get(f"{srv.url}/metrics", timeout=30).text
        assert metric(m, "specops_ralm_requests_total", retriever="exact", mode="ralmspec") >= 1
        labels = {"retriever": "bm25", "mode": "ralmseq"}
        assert (
            metric(m, "specops_ralm_kb_queries_total", **labels) - metric(m0, "specops_ralm_kb_queries_total", **labels)
            == 4
        )

        def bad(retrieval, **extra):
            return _post(srv, prompt="x", max_tokens=2, retrieval=retrieval, **extra)

        assert_error(bad({"kb": "nope"}), 400, "invalid_request", "retrieval.kb")
        assert_error(bad({"kb": "tools", "retriever": "hnsw"}), 400, "invalid_request", "retrieval.retriever")
        assert_error(bad({"kb": "tools", "stride": 0}), 400, "invalid_request", "retrieval.stride")
        assert_error(bad({"kb": "tools", "mode": "sometimes"}), 400, "invalid_request", "retrieval.mode")
        assert_error(bad({"kb": "tools", "prefetch": 999}), 400, "invalid_request", "retrieval.prefetch")
        assert_error(bad({"mode": "ralmspec"}), 400, "invalid_request", "retrieval.kb")
        assert_error(
            bad({"kb": "tools"}, speculation={"method": "dresd"}), 400, "invalid_request", "speculation.method"
        )


def test_oneshot_retrieval_puts_top_passages_before_the_prompt_and_llma_copies_them(tiny_models, kb_dir, tmp_path):
    """retrieval.mode 'oneshot' (the LLMA paper's RAG setting): one KB search, the top passages
    before the prompt; LLMA copies from them (source 'retrieved') and answers as target-only does."""
    with running(serve_config(tiny_models, kb_dirs=[str(kb_dir)]), tmp_path / "srv") as srv:
        m0 = requests.get(f"{srv.url}/metrics", timeout=30).text  # counters are per process: other tests count too
        prompt = "Question: which command copies directories recursively, keeping the tree?\nAnswer:"
        texts = {}
        for method in ("target", "llma", "pld"):  # oneshot is a longer prompt: any method decodes it
            r = _post(
                srv,
                prompt=prompt,
                max_tokens=24,
                speculation={"method": method},
                retrieval={"kb": "tools", "mode": "oneshot", "retriever": "exact", "passages": 3},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            texts[method] = body["choices"][0]["text"]
            ret = body["retrieval"]
            assert ret["mode"] == "oneshot" and ret["kb_calls"] == 1 and len(ret["passages"]) == 3
            assert "cp(1)" in {p["title"] for p in ret["passages"]} and ret["context_tokens"] > 0
        assert texts["llma"] == texts["target"] == texts["pld"]  # greedy: the drafter never changes the output
        llma = _post(
            srv,
            prompt=prompt,
            max_tokens=24,
            speculation={"method": "llma"},
            references=["cp -r src dst"],
            retrieval={"kb": "tools", "mode": "oneshot", "retriever": "bm25", "passages": 2},
        ).json()
        assert llma["speculation"]["llma"]["reference_tokens"] > 5  # the request's text and the 2 passages
        assert set(llma["speculation"]["llma"]) >= {"hits_retrieved", "hits_request", "hits_context"}
        m = requests.get(f"{srv.url}/metrics", timeout=30).text
        for name, retriever, n in (("requests", "exact", 3), ("kb_calls", "bm25", 1)):
            labels = {"retriever": retriever, "mode": "oneshot"}
            assert (
                metric(m, f"specops_ralm_{name}_total", **labels) - metric(m0, f"specops_ralm_{name}_total", **labels)
                == n
            )
        bad = _post(srv, prompt="x", max_tokens=2, retrieval={"kb": "tools", "mode": "oneshot", "passages": 0})
        assert_error(bad, 400, "invalid_request", "retrieval.passages")
        bad = _post(
            srv,
            prompt="x",
            max_tokens=2,
            speculation={"method": "llma"},
            references=["y"],
            retrieval={"kb": "tools", "mode": "ralmspec"},
        )
        assert_error(bad, 400, "invalid_request", "references")


def test_knnlm_requests_and_errors(tiny_models, kb_dir, tmp_path):
    from specops.core.models import load_model, load_tokenizer, tokenizer_hash
    from specops.serving.ralm.knnlm.store import build_knnlm

    target, tok = load_model(tiny_models / "target"), load_tokenizer(tiny_models / "target")
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS.values()] * 3
    store = build_knnlm(target, docs, tokenizer_sha256=tokenizer_hash(tok), progress=False)
    path = store.save(tmp_path / "prose")
    cfg = serve_config(tiny_models, kb_dirs=[str(kb_dir)], knnlm_dirs=[str(path)])
    with running(cfg, tmp_path / "srv") as srv:
        m0 = requests.get(f"{srv.url}/metrics", timeout=30).text  # counters are per process: other tests count too
        out = {}
        for speculative in (False, True):
            r = _post(
                srv,
                prompt="ls lists directory",
                max_tokens=12,
                knnlm={"datastore": "prose", "lambda": 0.5, "k": 8, "speculative": speculative},
            )
            assert r.status_code == 200, r.text
            out[speculative] = r.json()
        assert out[True]["choices"][0]["text"] == out[False]["choices"][0]["text"]  # same output
        block = out[True]["knnlm"]
        assert block["datastore"] == "prose" and block["version"] == "local" and block["mode"] == "speculative"
        assert block["tokens"] == 12 and block["kb_searches"] <= out[False]["knnlm"]["kb_searches"] == 12
        assert out[True]["speculation"]["knnlm_version"] == "local"
        m = requests.get(f"{srv.url}/metrics", timeout=30).text
        labels = {"searcher": "exact", "mode": "baseline"}
        assert (
            metric(m, "specops_knnlm_searches_total", **labels) - metric(m0, "specops_knnlm_searches_total", **labels)
            == 12
        )

        def bad(knnlm, **extra):
            return _post(srv, prompt="x", max_tokens=2, knnlm=knnlm, **extra)

        assert_error(bad({"datastore": "nope"}), 400, "invalid_request", "knnlm.datastore")
        assert_error(bad({"datastore": "prose", "k": 0}), 400, "invalid_request", "knnlm.k")
        assert_error(bad({"datastore": "prose", "lambda": 1.5}), 400, "invalid_request", "knnlm.lambda")
        assert_error(bad({"datastore": "prose"}, retrieval={"kb": "tools"}), 400, "invalid_request", "knnlm")
