"""The method catalogue is the one place methods are named: every consumer derives from it."""

from __future__ import annotations

import pytest

from specops.core.errors import InvalidRequestError
from specops.core.models import ModelPair
from specops.serving.http.config import ServeConfig
from specops.serving.http.schema import Speculation
from specops.serving.proposers import catalogue
from specops.serving.proposers.catalogue import (
    CATALOGUE,
    DEFAULT_K,
    METHODS,
    ProposerConfig,
    ProposerResources,
    build_proposer,
    method_spec,
)


def test_every_entry_builds_with_its_resources(tiny_pair):
    res = ProposerResources(pair=tiny_pair, datastore=object())  # any datastore: building does not search it
    for name, spec in CATALOGUE.items():
        proposer = build_proposer(ProposerConfig(method=name), res)
        assert (proposer is None) == (name == "target")
        if proposer is not None:
            assert proposer.name == name
        assert DEFAULT_K[name] == spec.default_k >= 1
        assert spec.needs <= set(catalogue.NEEDS)


def test_a_missing_need_is_the_callers_error(tiny_pair):
    no_draft = ModelPair(target=tiny_pair.target, draft=None, tokenizer=None)
    with pytest.raises(InvalidRequestError, match="needs a draft model") as e:
        build_proposer(ProposerConfig(method="draft"), ProposerResources(pair=no_draft))
    assert e.value.param == "speculation.method"
    assert build_proposer(ProposerConfig(method="pld"), ProposerResources(pair=no_draft)) is not None


def test_unknown_names_list_the_choices():
    for bad in ("dresd?", "", None, 3):
        with pytest.raises(InvalidRequestError, match="choose one of target, draft, pld, dresd"):
            method_spec(bad)
    with pytest.raises(InvalidRequestError):
        ProposerConfig(method="nope")


def test_api_config_and_cli_derive_their_choices_from_it():
    enum = Speculation.model_json_schema()["properties"]["method"]["anyOf"][0]["enum"]
    assert tuple(enum) == METHODS
    assert tuple(ServeConfig.model_json_schema()["properties"]["default_method"]["enum"]) == METHODS
    from specops.cli.main import build_parser

    gen = next(
        a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions if a.dest == "method"
    )
    assert tuple(gen.choices) == METHODS


def test_only_the_draft_method_has_the_draft_artifact():
    assert {n for n, s in CATALOGUE.items() if s.artifact == "draft"} == {"draft"}
    assert method_spec("pld").artifact is None and method_spec("target").artifact is None
