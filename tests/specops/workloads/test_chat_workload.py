"""The chat workload: distinct prompts in three domains, rendered as the server renders chat,
from sources the bootstrap corpus never contains."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

from specops.core.models import load_tokenizer, render_chat
from specops.trainer.bootstrap import corpus
from specops.workloads import chat_workload as cw


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_tokenizer(tiny_models / "target")


def test_at_least_1000_distinct_prompts_per_domain_none_repeats(tokenizer):
    parts = cw.chat_workload(tokenizer, {"router": 50, "served": 1000, "probe": 100})
    seen: set[tuple[int, ...]] = set()
    shapes: set[str] = set()
    for d in cw.DOMAINS:
        assert [len(parts[d][k]) for k in ("router", "served", "probe")] == [50, 1000, 100]
        for part in parts[d].values():
            for p in part:
                assert p.domain == d
                key = tuple(p.token_ids)
                assert key not in seen, p.text  # distinct by token ids, across parts and domains
                seen.add(key)
                shape = cw._shape(p.text)
                assert shape not in shapes, p.text  # and not the same request up to its numbers
                shapes.add(shape)


def test_prompts_are_the_servers_rendering_of_the_chat(tokenizer):
    parts = cw.chat_workload(tokenizer, {"served": 3}, domains=("math",))
    for p in parts["math"]["served"]:
        msgs = cw.messages_of(p)
        assert [m["role"] for m in msgs] == ["system", "user"] and msgs[1]["content"] == p.text
        ids = tokenizer(render_chat(tokenizer, msgs), add_special_tokens=False)["input_ids"]
        assert ids == p.token_ids


def test_parts_are_stable_when_a_later_part_grows(tokenizer):
    a = cw.chat_workload(tokenizer, {"router": 5, "served": 10}, domains=("sql",))
    b = cw.chat_workload(tokenizer, {"router": 5, "served": 40}, domains=("sql",))
    assert a["sql"]["router"] == b["sql"]["router"] and a["sql"]["served"] == b["sql"]["served"][:10]


def test_the_domains_look_like_their_names():
    sql, math_, api = (cw.chat_prompts(d, 20) for d in cw.DOMAINS)
    assert all("CREATE TABLE" in p.user and "Question:" in p.user for p in sql)
    assert all(any(ch.isdigit() for ch in p.user) for p in math_)
    assert all("`" in p.user and p.source.startswith("api:") for p in api)
    assert {p.source.split(":")[1].split(".")[0] for p in cw.chat_prompts("api", 2000)} >= {
        "numpy",
        "pandas",
        "networkx",
    }


def test_unknown_domain_and_too_many_prompts_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="unknown chat domain"):
        cw.chat_prompts("poetry", 3)
    # every candidate is tokenized before it raises: the held-out families' ~300 functions, not all 2,365
    with pytest.raises(ValueError, match="distinct prompts"):
        cw.chat_workload(tokenizer, {"served": 10**6}, domains=("api",), families="held_out")


def test_the_bootstrap_corpus_never_lists_the_workloads_sources(tmp_path):
    """The api domain reads installed packages; no file under site-packages or dist-packages is
    ever in the corpus, whichever files this machine holds (checked on a planted tree, and on
    this machine's real listing)."""
    sources = cw.source_files()
    assert sources and all(corpus.excluded(f) for f in sources)
    root = tmp_path / "lib" / "python3.11"
    for rel in (
        "json/decoder.py",
        "site-packages/numpy/linalg.py",
        "dist-packages/pandas/core.py",
        "encodings/site-packages/x.py",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("def f():\n    return 1\n")
    assert [p.relative_to(root).as_posix() for p in corpus.list_code_files(root)] == ["json/decoder.py"]
    share = tmp_path / "share"
    for rel in ("doc/pkg/copyright", "doc/site-packages/README"):
        (share / rel).parent.mkdir(parents=True, exist_ok=True)
        (share / rel).write_text("text " * 100)
    assert [p.relative_to(share).as_posix() for p in corpus.list_prose_files(share)] == ["doc/pkg/copyright"]
    listed = {str(p) for p in corpus.list_code_files(Path(sysconfig.get_paths()["stdlib"]))}
    assert listed.isdisjoint(str(f) for f in sources)


def test_the_template_disjoint_split_holds_whole_families_out_of_traffic(tokenizer):
    """Issue 55: a probe from families (sql schemas, math templates, api packages) that served
    traffic never has; traffic is the full workload less those families, in the same order."""
    for d in cw.DOMAINS:
        everything = cw.chat_prompts(d, 300)
        seen = cw.chat_prompts(d, 200, families="seen")
        held = cw.chat_prompts(d, 40, families="held_out")
        assert {cw.family(p.source) for p in held} == set(cw.HELD_OUT[d]), d  # every held-out family, only those
        assert not {cw.family(p.source) for p in seen} & cw.HELD_OUT[d]
        kept = [p for p in everything if cw.family(p.source) not in cw.HELD_OUT[d]]
        assert seen[: len(kept)] == kept[: len(seen)], d  # the same prompts, less the held-out ones
    parts = cw.chat_workload(tokenizer, {"served": 50}, domains=("math",), families="seen")
    probe = cw.chat_workload(tokenizer, {"probe": 10}, domains=("math",), families="held_out")
    assert not {tuple(p.token_ids) for p in parts["math"]["served"]} & {
        tuple(p.token_ids) for p in probe["math"]["probe"]
    }
    assert cw.family("math:t02") == "t02" and cw.family("api:numpy.linalg.norm") == "numpy"
    with pytest.raises(ValueError, match="families"):
        cw.chat_prompts("sql", 3, families="some")


# ---------------------------------------------------------------- docs: real text, not templates
def test_docs_paragraphs_are_real_documentation_from_installed_sources():
    """Issue 55: the ``docs`` domain's prompts are documentation paragraphs as the pinned packages
    ship them (whitespace collapsed), read from site-packages, which the bootstrap never lists."""
    paras = cw.doc_paragraphs(("click", "jinja2"))
    assert len(paras) >= 50 and {p[0] for p in paras} == {"click", "jinja2"}
    files = cw.source_files(("click", "jinja2"))
    assert files and all(corpus.excluded(f) for f in files)
    text = " ".join(" ".join(f.read_text(encoding="utf-8").split()) for f in files)
    for _pkg, module, para in paras[:40]:
        assert para in text, (module, para)  # verbatim, not generated
        assert cw._is_prose(para)
    assert len({cw._near(p[2]) for p in paras}) == len(paras)  # no paragraph twice, even with names changed


def test_docs_prose_filter_drops_parameter_lists_doctest_and_markup():
    prose = (
        "The request context contains per-request information. The application creates and pushes it at the "
        "beginning of the request, then pops it at the end of the request. It will create the URL adapter "
        "and request object for the environment provided."
    )
    assert cw._is_prose(prose)
    assert not cw._is_prose("Args: " + prose)
    assert not cw._is_prose(prose + " path: the file to read. mode: how to open it.")
    assert not cw._is_prose(prose[:150])  # too short to rewrite
    assert cw._MARKUP.search(">>> f(1)\n2") and cw._MARKUP.search(".. note::\n   x")


def test_docs_domain_serves_a_full_run_and_holds_packages_out(tokenizer, small_docs):
    parts = cw.chat_workload(
        tokenizer, {"router": 50, "served": 1000, "probe": 100}, domains=("docs",), families="seen"
    )["docs"]
    held = cw.chat_workload(tokenizer, {"probe": 100}, domains=("docs",), families="held_out")["docs"]["probe"]
    served = [p for part in parts.values() for p in part]
    assert len(served) == 1150 and len(held) == 100
    assert not {cw.family(p.source) for p in served} & cw.HELD_OUT["docs"]
    assert {cw.family(p.source) for p in held} <= cw.HELD_OUT["docs"]
    paragraph = lambda p: p.text.split("\n\n", 1)[1]  # noqa: E731
    assert not {paragraph(p) for p in served} & {paragraph(p) for p in held}
    assert len({paragraph(p) for p in served}) == len(served)  # each paragraph once, whatever the ask
    assert cw.messages_of(held[0])[0]["content"] == cw.SYSTEM["docs"] and cw.family("docs:flask.app") == "flask"
    assert "docs" not in cw.DOMAINS and "docs" in cw.ALL_DOMAINS  # asked for, not in every run


def test_parsed_sources_are_cached_on_disk_keyed_by_the_files_they_read(tmp_path, monkeypatch):
    """The ``docs`` packages take half a minute to read with ``ast``: the rows are kept under
    ``$SPECOPS_CACHE_DIR``, read back unchanged, and parsed again when a source changes or the
    file is not a valid result."""
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))
    real = cw._parse_doc_paragraphs(("click",))  # a real package: what the cache gives back is the parse, exactly
    assert cw._disk_cached("docs", ("click",), cw._parse_doc_paragraphs) == real
    assert cw._disk_cached("docs", ("click",), lambda packages: pytest.fail("parsed again")) == real
    src = tmp_path / "site-packages" / "fakepkg" / "mod.py"
    src.parent.mkdir(parents=True)
    para = (
        "This module reads the settings of an application from a file and keeps them in memory, so that "
        "every later request can look a value up without opening the file again. It is {} for the tests only."
    )
    src.write_text(f'"""{para.format("written")}"""\n')
    monkeypatch.setattr(cw, "source_files", lambda packages: [src])
    before = set((tmp_path / "cache" / "chat_workload").glob("docs-*.json"))
    calls = []

    def parse(packages):
        calls.append(packages)
        return cw._parse_doc_paragraphs(packages)

    first = cw._disk_cached("docs", ("fakepkg",), parse)
    assert first == (("fakepkg", "fakepkg.mod", para.format("written")),) and len(calls) == 1
    (cached,) = set((tmp_path / "cache" / "chat_workload").glob("docs-*.json")) - before
    assert cw._disk_cached("docs", ("fakepkg",), parse) == first and len(calls) == 1  # read back, not parsed
    cached.write_text(json.dumps({"rows": [["only", "two"]]}))  # not a valid result: parsed again, rewritten
    assert cw._disk_cached("docs", ("fakepkg",), parse) == first and len(calls) == 2
    assert json.loads(cached.read_text())["rows"] == [list(first[0])]
    src.write_text(f'"""{para.format("rewritten")}"""\n')  # a changed source is a new key
    os.utime(src, ns=(1, 1))
    assert cw._disk_cached("docs", ("fakepkg",), parse)[0][2] == para.format("rewritten") and len(calls) == 3
    for i in range(cw._CACHE_KEEP + 2):  # a new key each time: only the newest few files are kept
        os.utime(src, ns=(2 + i, 2 + i))
        cw._disk_cached("docs", ("fakepkg",), parse)
    assert len(list((tmp_path / "cache" / "chat_workload").glob("docs-*.json"))) == cw._CACHE_KEEP


def test_definitions_are_ast_walks_definitions_in_its_order():
    """``_definitions`` skips expression nodes, so it must still find every module, class and function
    (inside ``if``, ``try``/``except``/``finally``, ``with``, ``match`` cases, loops and other
    definitions) in ``ast.walk``'s breadth-first order, which decides which near-duplicate paragraph wins."""
    import ast
    import textwrap

    source = textwrap.dedent(
        '''
        """module"""
        def a():
            def a_inner(): pass
        if True:
            class B:
                def b(self): pass
        else:
            def c(): pass
        try:
            def d(): pass
        except ValueError:
            def e(): pass
        else:
            def f(): pass
        finally:
            def g(): pass
        with open("x") as fh:
            async def h(): pass
        for i in range(2):
            def j(): pass
        while False:
            def k(): pass
        match 1:
            case 1:
                def m(): pass
        x = lambda: [n for n in range(3)]
        '''
    )
    tree = ast.parse(source)
    expected = [n for n in ast.walk(tree) if isinstance(n, cw._DEFINITIONS)]
    got = list(cw._definitions(tree))
    assert got == expected
    names = [getattr(n, "name", "<module>") for n in got]
    assert len(names) == 14 and names[0] == "<module>" and set("abcdefghjkm") <= {n[0] for n in names}
