"""Rewrite the ``serving.config`` and ``trainer.config`` parts of the chart's values.schema.json from the app.

``serving.config`` becomes serve.toml, so its keys are ServeConfig's fields (serving/http/config.py);
``trainer.config`` becomes train.toml, so its keys are ``specops train``'s long options with ``-``
as ``_``. Both lists are generated here, with each field's type, choices and help, so that a typo
or a wrong type fails at ``helm install`` rather than when the pod starts. The fields the chart
sets itself are left out (the schema then refuses them). ``serving.engine`` and the ServeConfig
fields under ``serving.vllm`` (:data:`VLLM_VALUES`) are generated too, with their bounds; the rest
of the schema (``serving.vllm.image``, ``serving.vllm.gpuMemoryUtilization``, ...) is maintained by hand.

    python deploy/helm/tools/config_schema.py          # rewrite values.schema.json
    python deploy/helm/tools/config_schema.py --check  # exit 1 when it is out of date

tests/deploy/test_helm.py fails when the app gains or loses a field and this was not re-run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[1] / "specops" / "values.schema.json"
VLLM_VALUES = {
    "speculation": "vllm_speculation",
    "k": "vllm_k",
    "maxModelLen": "vllm_max_model_len",
    "kvCacheGb": "vllm_kv_cache_gb",
    "args": "vllm_args",
    "startTimeoutS": "vllm_start_timeout_s",
}
"""``serving.vllm.<value>`` -> the ServeConfig field the chart renders it as (with ``serving.engine`` as ``engine``)."""
SERVE_OWNED = ("host", "port", "model_dir", "api_keys", "engine", *VLLM_VALUES.values())
"""serve.toml fields the chart sets (api_keys: from a Secret, as $SPECOPS_API_KEYS; engine and vllm_*: from
serving.engine and serving.vllm, because they also pick the image, the probes and the GPU settings)."""
_BOUNDS = ("enum", "type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
TRAIN_OWNED = ("out", "model_dir", "schedule", "jobstore", "backend", "metrics_port", "zero_stage")
"""train.toml keys the chart sets (metrics_port from trainer.metrics.port, zero_stage from trainer.zeroStage)."""
_DEFAULT_NOTE = re.compile(r"\s*\(default(?:[^()]|\([^()]*\))*\)")
"""An argparse help's "(default: %(default)s)" note, nested parentheses included."""


def _pydantic_type(annotation) -> dict:
    if typing.get_origin(annotation) is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if typing.get_origin(annotation) is list:
        return {"type": "array", "items": {"type": "string"}}
    types = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation not in types:
        raise TypeError(f"no JSON type for {annotation!r}: extend _pydantic_type")
    return {"type": types[annotation]}


def serve_config_schema() -> dict:
    from specops.serving.http.config import ServeConfig

    enums = {  # fields whose choices are read when asked (default_method: the method catalogue's)
        name: {"enum": prop["enum"]}
        for name, prop in ServeConfig.model_json_schema()["properties"].items()
        if "enum" in prop
    }
    props = {
        name: {**enums.get(name, _pydantic_type(f.annotation)), "description": f.description}
        for name, f in ServeConfig.model_fields.items()
        if name not in SERVE_OWNED
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": props,
        "description": "serve.toml: ServeConfig fields (serving/http/config.py) but "
        f"{', '.join(SERVE_OWNED)}, which the chart sets",
    }


def serve_field_schema(name: str) -> dict:
    """One ServeConfig field as a values schema entry: its choices or type, its bounds and its description."""
    from specops.serving.http.config import ServeConfig

    prop = ServeConfig.model_json_schema()["properties"][name]
    return {**{k: prop[k] for k in _BOUNDS if k in prop}, "description": prop["description"]}


def train_config_schema() -> dict:
    from specops.cli import build_parser
    from specops.config_file import options_of

    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    props = {}
    for key, action in options_of(train).items():
        if key in TRAIN_OWNED:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            prop = {"type": "boolean"}
        elif action.choices:
            prop = {"enum": list(action.choices)}
        elif action.type is float:
            prop = {"type": "number"}
        elif action.type is not None and action.type is not str:
            prop = {"type": "integer"}
        else:
            prop = {"type": "string"}
        prop["description"] = _DEFAULT_NOTE.sub("", action.help or "").replace("%%", "%")
        props[key] = prop
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": props,
        "description": "train.toml: `specops train` long options with - as _, but "
        f"{', '.join(TRAIN_OWNED)}, which the chart sets",
    }


def updated(schema: dict) -> dict:
    out = json.loads(json.dumps(schema))
    serving = out["properties"]["serving"]["properties"]
    serving["config"] = serve_config_schema()
    serving["engine"] = serve_field_schema("engine")
    vllm = serving.setdefault("vllm", {"type": "object", "properties": {}, "additionalProperties": False})
    for value, field in VLLM_VALUES.items():
        vllm["properties"][value] = serve_field_schema(field)
    out["properties"]["trainer"]["properties"]["config"] = train_config_schema()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether values.schema.json is up to date")
    args = parser.parse_args(argv)
    current = json.loads(SCHEMA.read_text())
    new = updated(current)
    if args.check:
        if new != current:
            print(f"{SCHEMA} is out of date: run python deploy/helm/tools/config_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(json.dumps(new, indent=2) + "\n")
    print(f"wrote {SCHEMA}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    sys.exit(main())
