"""The method catalogue is the one place methods are named: every consumer derives from it."""

from __future__ import annotations

import pytest

from specops.core.errors import InvalidRequestError
from specops.core.models import ModelPair
from specops.serving.engine.types import SamplingParams
from specops.serving.http.config import ServeKeys
from specops.serving.http.schema import Speculation
from specops.serving.plan import DecodePlan, plain_proposer
from specops.serving.proposers import catalogue
from specops.serving.proposers.catalogue import (
    CATALOGUE,
    DEFAULT_K,
    METHODS,
    ProposerResources,
    method_spec,
)


def test_every_entry_builds_with_its_resources(tiny_pair):
    res = ProposerResources(pair=tiny_pair, datastore=object())  # any datastore: building does not search it
    for name, spec in CATALOGUE.items():
        proposer = plain_proposer(res, method=name)
        assert (proposer is None) == (name == "target")
        if proposer is not None:
            assert proposer.name == name
        assert DEFAULT_K[name] == spec.default_k >= 1
        assert spec.needs <= set(catalogue.NEEDS)


def test_a_missing_need_is_the_callers_error(tiny_pair):
    no_draft = ModelPair(target=tiny_pair.target, draft=None, tokenizer=None)
    with pytest.raises(InvalidRequestError, match="needs a draft model") as e:
        plain_proposer(ProposerResources(pair=no_draft), method="draft")
    assert e.value.param == "speculation.method"
    assert plain_proposer(ProposerResources(pair=no_draft), method="pld") is not None


def test_unknown_names_list_the_choices():
    for bad in ("dresd?", "", None, 3):
        with pytest.raises(InvalidRequestError, match="choose one of target, draft, pld, dresd"):
            method_spec(bad)
    with pytest.raises(InvalidRequestError):
        DecodePlan.plain([1], SamplingParams(), method="nope")


def test_api_config_and_cli_derive_their_choices_from_it():
    enum = Speculation.model_json_schema()["properties"]["method"]["anyOf"][0]["enum"]
    assert tuple(enum) == METHODS
    assert tuple(ServeKeys.model_json_schema()["properties"]["default_method"]["enum"]) == METHODS
    from specops.cli.main import build_parser

    gen = next(
        a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions if a.dest == "method"
    )
    assert tuple(gen.choices) == METHODS


def test_only_the_draft_method_has_the_draft_artifact():
    assert {n for n, s in CATALOGUE.items() if s.artifact == "draft"} == {"draft"}
    assert method_spec("pld").artifact is None and method_spec("target").artifact is None


def test_the_docs_method_table_is_generated_from_it():
    """docs/api.md's table of methods and their options is the catalogue's (rewrite it with
    ``python -m specops.serving.proposers.catalogue docs/api.md``)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    assert catalogue.write_method_table(page) == page, "run: python -m specops.serving.proposers.catalogue docs/api.md"
    assert all(f"| `{name}` |" in page for name in catalogue.METHODS)


def test_each_method_owns_its_options():
    """A method's options model holds its fields, defaults and bounds; another method's option,
    or a value out of bounds, is the caller's error naming ``speculation.<field>``."""
    llma = method_spec("llma")
    assert llma.parse_options({}).n == 1 and llma.parse_options({"n": 3}).n == 3
    for spec, given, field in [
        (llma, {"n": 0}, "speculation.n"),
        (llma, {"n": "2"}, "speculation.n"),
        (method_spec("pld"), {"n": 2}, "speculation.n"),
        (method_spec("pld"), {"pld_min_ngram": 4, "pld_max_ngram": 2}, "speculation.pld_min_ngram"),
        (method_spec("target"), {"search_k": 8}, "speculation.search_k"),
        (method_spec("retrieval"), {"dense_below": 18}, "speculation.dense_below"),
        (method_spec("retrieval"), {"exact_nodes": 0}, "speculation.exact_nodes"),
        (method_spec("dresd"), {"dense_below": 2}, "speculation.dense_below"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            spec.parse_options(given)
        assert e.value.param == field, (spec.name, given)
