"""Render, lint and validate the Helm chart ``deploy/helm/specops`` offline.

Rendering and linting go through ``helm_python`` (helm-python-sdk: Helm's own Go SDK behind a
C ABI, loaded with ctypes), so no ``helm`` binary and no cluster are involved, and the chart's
``values.schema.json`` is enforced exactly as ``helm install`` enforces it. Every render is
cached per (values file, overrides): a test module renders each value set once.

What :func:`validate_object` checks:

- **Built-in kinds** (Deployment, Service, ConfigMap, Secret, PVC, PDB, CronJob, HPA,
  NetworkPolicy, ServiceAccount): ``kubernetes_validate`` in strict mode against the
  Kubernetes :data:`KUBE_VERSION` OpenAPI schemas, so unknown fields, wrong types and
  missing required fields fail.
- **CRD kinds** (ServiceMonitor, PrometheusRule, ScaledObject, Strimzi Kafka / KafkaNodePool / KafkaTopic,
  Gateway API HTTPRoute):
  ``kubernetes_validate`` has no schema for them (it raises ``SchemaNotFoundError``), so they
  are checked against the small schemas in :data:`CRD_SCHEMAS`, written by hand from the
  upstream CRDs (prometheus-operator v0.8x, KEDA 2.x, Strimzi 0.4x ``v1beta2``, Gateway API v1.x ``v1``). They cover
  the fields this chart writes: required fields, enums, types and unknown keys at the levels
  the chart fills in, plus the operator-side rules the CRDs do not encode (KEDA trigger
  metadata values are strings; a prometheus trigger needs serverAddress, query and threshold;
  Strimzi node pools and topics name their cluster in the ``strimzi.io/cluster`` label; a
  PrometheusRule's rule is either an alert or a recording rule, its label and annotation values
  are strings, and its group names are unique).
  They are not the full upstream schemas: fields the chart never writes are only checked
  to be there by name.
- A kind with neither is an error, so a new CRD in the chart must bring its schema here.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "specops"
CI_DIR = CHART_DIR / "ci"
RELEASE = "prod"
NAMESPACE = "specops"
KUBE_VERSION = "1.33"
"""Kubernetes version the built-in objects are validated for (the chart's kubeVersion is >=1.30)."""

# kubernetes_validate re-reads its 1.4 MB definitions file for every object; reading each file once
# makes validating a render ~5x faster. The parsed schemas are only read, never changed.
if not hasattr(kubernetes_validate.utils.schema_contents, "cache_info"):
    kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
        kubernetes_validate.utils.schema_contents
    )

RenderError = helm.HelmError
"""What a rejected value set raises: ``HelmValuesError`` (schema) or ``HelmRenderError`` (a template's ``fail``)."""


def ci_value_files() -> list[Path]:
    """Every value set under the chart's ``ci/`` folder."""
    return sorted(CI_DIR.glob("*.yaml"))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_values(values_file: Path | None, set_values: dict | None = None) -> dict:
    """The values a ``helm install -f values_file --set ...`` passes (the file parsed by Helm's own YAML reader)."""
    values = helm.values_from_yaml(Path(values_file).read_text()) if values_file else {}
    return _merge(values, set_values or {})


@functools.lru_cache(maxsize=64)
def _render_cached(values_file: str | None, set_json: str) -> dict[str, str]:
    values = load_values(Path(values_file) if values_file else None, json.loads(set_json))
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def render_files(values_file: Path | None = None, set_values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included). Raises :data:`RenderError` on rejected values."""
    key = str(values_file) if values_file else None
    return dict(_render_cached(key, json.dumps(set_values or {}, sort_keys=True)))


def render(values_file: Path | None = None, set_values: dict | None = None) -> list[dict]:
    """Every object the chart renders, parsed, in template order (a fresh copy each call)."""
    objects = _parse_cached(str(values_file) if values_file else None, json.dumps(set_values or {}, sort_keys=True))
    return copy.deepcopy(objects)


@functools.lru_cache(maxsize=64)
def _parse_cached(values_file: str | None, set_json: str) -> list[dict]:
    files = _render_cached(values_file, set_json)
    objects: list[dict] = []
    for path in sorted(files):
        if not path.endswith((".yaml", ".yml")):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(files[path]) if doc)
    return objects


def notes(values_file: Path | None = None, set_values: dict | None = None) -> str:
    """The rendered NOTES.txt."""
    return next(text for path, text in render_files(values_file, set_values).items() if path.endswith("NOTES.txt"))


@functools.lru_cache(maxsize=16)
def _lint_cached(values_file: str | None, set_json: str, strict: bool) -> str:
    values = load_values(Path(values_file) if values_file else None, json.loads(set_json))
    report = helm.lint(CHART_DIR, values, strict=strict, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0")
    return json.dumps(report)


def lint(values_file: Path | None = None, set_values: dict | None = None, *, strict: bool = True) -> dict[str, Any]:
    """``helm lint [--strict]``: ``{"messages": [{"severity", "path", "error"}], "errors": [...]}``
    (severity 1 info, 2 warning, 3 error)."""
    key = str(values_file) if values_file else None
    return json.loads(_lint_cached(key, json.dumps(set_values or {}, sort_keys=True), strict))


# ------------------------------------------------------------------ finding objects
def component(obj: dict) -> str | None:
    return obj.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component")


def find(objects: list[dict], kind: str, component_name: str | None = None) -> list[dict]:
    """Objects of ``kind`` (and of the component, when given)."""
    return [o for o in objects if o["kind"] == kind and (component_name is None or component(o) == component_name)]


def one(objects: list[dict], kind: str, component_name: str | None = None) -> dict:
    found = find(objects, kind, component_name)
    assert len(found) == 1, f"expected one {kind} {component_name or ''}, rendered {len(found)}"
    return found[0]


def pod_spec(obj: dict) -> dict:
    """The pod spec of a Deployment or a CronJob."""
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def container(obj: dict, name: str) -> dict:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def trainer_launch_argv(objects: list[dict]) -> list[str]:
    """The trainer container's command + args: what the pod runs after the image's ENTRYPOINT (tini)."""
    trainer = container(one(objects, "Deployment", "trainer"), "trainer")
    return [str(a) for a in trainer.get("command", [])] + [str(a) for a in trainer.get("args", [])]


def literal_env(c: dict) -> dict[str, str]:
    """A container's environment variables with literal values (valueFrom ones left out)."""
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


# ------------------------------------------------------------------ validation
_NAME = {"type": "string", "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_QUANTITY = {
    "anyOf": [
        {"type": "integer"},
        {"type": "string", "pattern": r"^[0-9.]+([eE][-+]?[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$"},
    ]
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": _LABEL_VALUE},
        "matchExpressions": {"type": "array"},
    },
}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}


def _crd(
    api_version: str, kind: str, spec: dict, *, cluster_label: bool = False, annotations: dict | None = None
) -> dict:
    metadata: dict = {
        "type": "object",
        "required": ["name", "labels"],
        "properties": {"name": _NAME, "labels": {"type": "object", "additionalProperties": _LABEL_VALUE}},
    }
    if cluster_label:
        metadata["properties"]["labels"]["required"] = ["strimzi.io/cluster"]
    if annotations:
        metadata["required"].append("annotations")
        metadata["properties"]["annotations"] = annotations
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": spec,
        },
    }


def _obj(properties: dict, required: list[str] | None = None, *, extra: tuple[str, ...] = ()) -> dict:
    """An object whose keys must be among ``properties`` and ``extra`` (upstream fields the chart does not write)."""
    props = dict(properties) | {name: {} for name in extra}
    return {"type": "object", "additionalProperties": False, "required": required or [], "properties": props}


SERVICE_MONITOR = _crd(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _obj(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _obj(
                {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
            ),
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "honorLabels": {"type": "boolean"},
                    },
                    extra=(
                        "authorization",
                        "basicAuth",
                        "bearerTokenSecret",
                        "enableHttp2",
                        "filterRunning",
                        "followRedirects",
                        "honorTimestamps",
                        "metricRelabelings",
                        "oauth2",
                        "params",
                        "proxyUrl",
                        "relabelings",
                        "targetPort",
                        "tlsConfig",
                        "trackTimestampsStaleness",
                    ),
                ),
            },
        },
        ["selector", "endpoints"],
        extra=(
            "attachMetadata",
            "jobLabel",
            "podTargetLabels",
            "sampleLimit",
            "scrapeClass",
            "scrapeProtocols",
            "targetLabels",
            "targetLimit",
            "labelLimit",
            "keepDroppedTargets",
        ),
    ),
)

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_RULE = {
    **_obj(
        {
            "alert": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "expr": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},  # IntOrString upstream
            "for": _DURATION,
            "keep_firing_for": _DURATION,
            "labels": {**_STRINGS, "propertyNames": {"pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}},
            "annotations": _STRINGS,
        },
        ["expr"],
    ),
    "oneOf": [
        {"required": ["alert"], "not": {"required": ["record"]}},
        {"required": ["record"], "not": {"anyOf": [{"required": ["for"]}, {"required": ["annotations"]}]}},
    ],
}
PROMETHEUS_RULE = _crd(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _obj(
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _DURATION,
                        "rules": {"type": "array", "minItems": 1, "items": _RULE},
                    },
                    ["name", "rules"],
                    extra=("labels", "limit", "partial_response_strategy", "query_offset"),
                ),
            },
        },
        ["groups"],
    ),
)

_PROMETHEUS_TRIGGER = {
    "if": {"properties": {"type": {"const": "prometheus"}}},
    "then": {"properties": {"metadata": {"required": ["serverAddress", "query", "threshold"]}}},
}
SCALED_OBJECT = _crd(
    "keda.sh/v1alpha1",
    "ScaledObject",
    _obj(
        {
            "scaleTargetRef": _obj(
                {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "envSourceContainerName": {"type": "string"},
                },
                ["name"],
            ),
            "minReplicaCount": _INT32,
            "maxReplicaCount": _INT32,
            "idleReplicaCount": _INT32,
            "pollingInterval": _INT32,
            "cooldownPeriod": _INT32,
            "initialCooldownPeriod": _INT32,
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    **_obj(
                        {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },  # KEDA refuses non-string values
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": _obj(
                                {
                                    "name": {"type": "string"},
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                                ["name"],
                            ),
                        },
                        ["type", "metadata"],
                    ),
                    **_PROMETHEUS_TRIGGER,
                },
            },
            "fallback": _obj(
                {
                    "failureThreshold": {"type": "integer", "minimum": 0},
                    "replicas": {"type": "integer", "minimum": 0},
                    "behavior": {
                        "enum": ["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]
                    },
                },
                ["failureThreshold", "replicas"],
            ),
            "advanced": _obj(
                {
                    "horizontalPodAutoscalerConfig": _obj(
                        {"name": {"type": "string"}, "behavior": _obj({"scaleUp": {}, "scaleDown": {}})}
                    ),
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                },
                extra=("scalingModifiers",),
            ),
        },
        ["scaleTargetRef", "triggers"],
    ),
)

_STRIMZI = "kafka.strimzi.io/v1beta2"
_ENABLED = {"type": "string", "enum": ["enabled", "disabled"]}
KAFKA = _crd(
    _STRIMZI,
    "Kafka",
    _obj(
        {
            "kafka": _obj(
                {
                    "version": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
                    "metadataVersion": {"type": "string"},
                    "listeners": {
                        "type": "array",
                        "minItems": 1,
                        "items": _obj(
                            {
                                "name": {"type": "string", "pattern": "^[a-z0-9]{1,11}$"},
                                "port": {"type": "integer", "minimum": 9092},
                                "type": {
                                    "enum": ["internal", "route", "loadbalancer", "nodeport", "ingress", "cluster-ip"]
                                },
                                "tls": {"type": "boolean"},
                            },
                            ["name", "port", "type", "tls"],
                            extra=("authentication", "configuration", "networkPolicyPeers"),
                        ),
                    },
                    "config": {
                        "type": "object",
                        "additionalProperties": {"type": ["string", "integer", "number", "boolean"]},
                    },
                    "resources": {"type": "object"},
                },
                ["listeners"],
                extra=(
                    "authorization",
                    "rack",
                    "jvmOptions",
                    "jmxOptions",
                    "logging",
                    "metricsConfig",
                    "template",
                    "livenessProbe",
                    "readinessProbe",
                    "tieredStorage",
                    "quotas",
                    "image",
                    "brokerRackInitImage",
                ),
            ),
            "entityOperator": _obj(
                {"topicOperator": {"type": "object"}, "userOperator": {"type": "object"}},
                extra=("template", "tlsSidecar"),
            ),
        },
        ["kafka"],
        extra=("clusterCa", "clientsCa", "cruiseControl", "kafkaExporter", "maintenanceTimeWindows"),
    ),
    annotations={
        "type": "object",
        "required": ["strimzi.io/node-pools", "strimzi.io/kraft"],
        "properties": {"strimzi.io/node-pools": {"const": "enabled"}, "strimzi.io/kraft": _ENABLED},
    },
)

KAFKA_NODE_POOL = _crd(
    _STRIMZI,
    "KafkaNodePool",
    _obj(
        {
            "replicas": {"type": "integer", "minimum": 0},
            "roles": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": ["controller", "broker"]}},
            "storage": {
                **_obj(
                    {
                        "type": {"enum": ["ephemeral", "persistent-claim", "jbod"]},
                        "volumes": {
                            "type": "array",
                            "minItems": 1,
                            "items": _obj(
                                {
                                    "id": {"type": "integer", "minimum": 0},
                                    "type": {"enum": ["ephemeral", "persistent-claim"]},
                                    "size": _QUANTITY,
                                    "class": {"type": "string"},
                                    "deleteClaim": {"type": "boolean"},
                                    "kraftMetadata": {"enum": ["shared"]},
                                },
                                ["type"],
                                extra=("selector", "overrides", "sizeLimit"),
                            ),
                        },
                    },
                    ["type"],
                    extra=("size", "class", "deleteClaim", "selector", "sizeLimit"),
                ),
                "if": {"properties": {"type": {"const": "jbod"}}},
                "then": {"required": ["volumes"]},
            },
            "resources": {"type": "object"},
        },
        ["replicas", "roles", "storage"],
        extra=("jvmOptions", "template"),
    ),
    cluster_label=True,
)

KAFKA_TOPIC = _crd(
    _STRIMZI,
    "KafkaTopic",
    _obj(
        {
            "topicName": {"type": "string", "pattern": r"^[a-zA-Z0-9._-]{1,249}$"},
            "partitions": {"type": "integer", "minimum": 1},
            "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
            "config": {"type": "object", "additionalProperties": {"type": ["string", "integer", "number", "boolean"]}},
        },
        ["partitions", "replicas"],
    ),
    cluster_label=True,
)

_GATEWAY = "gateway.networking.k8s.io/v1"
_GATEWAY_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
HTTP_ROUTE = _crd(
    _GATEWAY,
    "HTTPRoute",
    _obj(
        {
            "parentRefs": {
                "type": "array",
                "maxItems": 32,
                "items": _obj(
                    {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                    },
                    ["name"],
                ),
            },
            "hostnames": {
                "type": "array",
                "maxItems": 16,
                "items": {
                    "type": "string",
                    "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                },
            },
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _obj(
                    {
                        "name": {"type": "string"},
                        "matches": {
                            "type": "array",
                            "items": _obj(
                                {
                                    "path": _obj(
                                        {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": {"type": "string", "pattern": "^/", "maxLength": 1024},
                                        }
                                    ),
                                },
                                extra=("headers", "queryParams", "method"),
                            ),
                        },
                        "backendRefs": {
                            "type": "array",
                            "items": _obj(
                                {
                                    "group": {"type": "string"},
                                    "kind": {"type": "string"},
                                    "name": {"type": "string", "minLength": 1},
                                    "namespace": {"type": "string"},
                                    "port": _PORT,
                                    "weight": {"type": "integer", "minimum": 0},
                                },
                                ["name", "port"],  # a Service backend needs its port (the CRD's CEL rule)
                                extra=("filters",),
                            ),
                        },
                        "timeouts": _obj({"request": _GATEWAY_DURATION, "backendRequest": _GATEWAY_DURATION}),
                    },
                    extra=("filters", "sessionPersistence", "retry"),
                ),
            },
        },
    ),
)

CRD_SCHEMAS: dict[tuple[str, str], dict] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    (_STRIMZI, "Kafka"): KAFKA,
    (_STRIMZI, "KafkaNodePool"): KAFKA_NODE_POOL,
    (_STRIMZI, "KafkaTopic"): KAFKA_TOPIC,
    (_GATEWAY, "HTTPRoute"): HTTP_ROUTE,
}


def validate_object(obj: dict, kube_version: str = KUBE_VERSION) -> str:
    """Validate one rendered object (built-in kinds for ``kube_version``); returns ``"builtin"`` or ``"crd"``.

    Raises ``kubernetes_validate.ValidationError`` or ``jsonschema.ValidationError`` when it is
    invalid, and ``LookupError`` for a kind neither knows.
    """
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
        return "builtin"
    except kubernetes_validate.SchemaNotFoundError:
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if schema is None:
            raise LookupError(f"no schema for {obj['apiVersion']} {obj['kind']}: add one to CRD_SCHEMAS") from None
        jsonschema.Draft202012Validator(schema).validate(obj)
        if obj["kind"] == "PrometheusRule":
            names = [g["name"] for g in obj["spec"]["groups"]]
            if len(set(names)) != len(names):
                raise jsonschema.ValidationError(
                    f"PrometheusRule {obj['metadata']['name']}: duplicate group names {names}"
                )
        return "crd"
