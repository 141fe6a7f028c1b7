"""Rewrite the ``serving.config`` and ``trainer.config`` parts of the chart's values.schema.json from the app.

``serving.config`` becomes serve.toml, so its keys are ServeConfig's fields (serving/http/config.py);
``trainer.config`` becomes train.toml, so its keys are ``specops train``'s long options with ``-``
as ``_``. Both lists are taken from pydantic's own JSON schema of the settings models that read
those files (``ServeKeys.model_json_schema()``, and the model ``specops/config_file.py`` generates
from train's options), with each field's type, choices and help, so that a typo or a wrong type
fails at ``helm install`` rather than when the pod starts. The fields the chart
sets itself are left out (the schema then refuses them). ``specops.serving.engine`` and the ServeConfig
fields under ``specops.serving.vllm`` (:data:`VLLM_VALUES`) are generated too, with their bounds; the rest
of the schema (``serving.vllm.image``, ``serving.vllm.gpuMemoryUtilization``, ...) is maintained by hand.

    python deploy/helm/tools/config_schema.py          # rewrite values.schema.json
    python deploy/helm/tools/config_schema.py --check  # exit 1 when it is out of date

tests/deploy/test_helm.py fails when the app gains or loses a field and this was not re-run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[1] / "specops" / "values.schema.json"
VLLM_VALUES = {
    "speculation": "vllm_speculation",
    "k": "vllm_k",
    "copyK": "vllm_copy_k",
    "standby": "vllm_standby",
    "draftVocab": "vllm_draft_vocab",
    "maxModelLen": "vllm_max_model_len",
    "kvCacheGb": "vllm_kv_cache_gb",
    "args": "vllm_args",
    "startTimeoutS": "vllm_start_timeout_s",
}
"""``specops.serving.vllm.<value>`` -> the ServeConfig field the chart renders it as (with ``specops.serving.engine`` as ``engine``)."""
SERVE_OWNED = ("host", "port", "model_dir", "api_keys", "engine", "shutdown_timeout_s", *VLLM_VALUES.values())
"""serve.toml fields the chart sets (api_keys: from a Secret, as $SPECOPS_API_KEYS; engine and vllm_*: from
specops.serving.engine and specops.serving.vllm, because they also pick the image, the probes and the GPU settings;
shutdown_timeout_s: from serving.terminationGracePeriodSeconds, preStopSleepSeconds and drainMarginSeconds)."""
_BOUNDS = ("enum", "type", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
TRAIN_OWNED = ("out", "model_dir", "schedule", "jobstore", "backend", "metrics_port", "zero_stage")
"""train.toml keys the chart sets (metrics_port from trainer.metrics.port, zero_stage from trainer.zeroStage)."""


def _key(prop: dict) -> dict:
    """A values schema entry from a pydantic JSON schema property: its choices (``enum`` alone) or its type
    (``items`` too for a list), and its description."""
    kind = {"enum": prop["enum"]} if "enum" in prop else {k: prop[k] for k in ("type", "items") if k in prop}
    if not kind:
        raise TypeError(f"no JSON type in {prop!r}: give the field a plain type")
    return {**kind, "description": prop["description"]}


def serve_config_schema() -> dict:
    from specops.serving.http.config import ServeKeys

    # default_method's choices are the method catalogue's, read when the schema is asked for
    properties = ServeKeys.model_json_schema()["properties"]
    props = {name: _key(prop) for name, prop in properties.items() if name not in SERVE_OWNED}
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": props,
        "description": "serve.toml: ServeConfig fields (serving/http/config.py) but "
        f"{', '.join(SERVE_OWNED)}, which the chart sets",
    }


def serve_field_schema(name: str) -> dict:
    """One serve key (``ServeKeys`` field) as a values schema entry: its choices or type, its bounds and its description."""
    from specops.serving.http.config import ServeKeys

    prop = ServeKeys.model_json_schema()["properties"][name]
    return {**{k: prop[k] for k in _BOUNDS if k in prop}, "description": prop["description"]}


def train_config_schema() -> dict:
    from specops.cli import train
    from specops.config_file import options_model

    sub = argparse.ArgumentParser().add_subparsers()
    train.add_parser(sub)
    properties = options_model(sub.choices["train"], "train").model_json_schema()["properties"]
    props = {key: _key(prop) for key, prop in properties.items() if key not in TRAIN_OWNED}
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
