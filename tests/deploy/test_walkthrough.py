"""``deploy/README.md``'s walkthrough as written: the Secrets its step 3 creates are the ones, and
hold the keys, that every pod the chart renders with step 3's values reads (issue 58: the README
created ``password`` and ``keys`` where the chart reads ``postgres-password`` and ``api-keys``),
the shell variables its steps use are set in an earlier step, the GPU value set reads the same
Secrets (it read keys ``password`` and ``keys``), every file and chart value the walkthrough names
exists, and the packaged chart keeps the value sets step 5 starts from (``.helmignore`` left out ``ci/``)."""

from __future__ import annotations

import re
import shlex

import yaml

from specops.serving.http.tenancy import split_key
from tests.deploy import helm_support as hs
from tests.deploy.test_helm import DEFAULT

README = hs.CHART_DIR.parent.parent / "README.md"
TEXT = README.read_text()
WALKTHROUGH = TEXT.split("#### From an empty cluster to a serving fleet", 1)[1].split("\n## ", 1)[0]


def _step(n: int) -> str:
    start = WALKTHROUGH.index(f"\n{n}. **")
    end = WALKTHROUGH.find(f"\n{n + 1}. **", start)
    return WALKTHROUGH[start : end if end > 0 else len(WALKTHROUGH)]


def _blocks(text: str, lang: str) -> list[str]:
    """The fenced ``lang`` blocks of ``text`` (indented as list items are), dedented, continuations joined."""
    out = []
    for m in re.finditer(rf"```{lang}\n(.*?)```", text, re.DOTALL):
        lines = [line.strip() for line in m.group(1).splitlines()]
        out.append("\n".join(lines).replace("\\\n", " "))
    return out


def _created_secrets() -> dict[str, dict[str, str]]:
    """Secret name -> {key: value} of step 3's ``kubectl create secret generic`` commands."""
    secrets: dict[str, dict[str, str]] = {}
    for block in _blocks(_step(3), "bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["kubectl"] and "secret" in words and "generic" in words:
                name = words[words.index("generic") + 1]
                literals = [w.removeprefix("--from-literal=") for w in words if w.startswith("--from-literal=")]
                secrets[name] = dict(lit.split("=", 1) for lit in literals)
    return secrets


def _step3_values() -> dict:
    (block,) = _blocks(_step(3), "yaml")
    return hs.helm.values_from_yaml(block)  # Helm's own YAML reader


def test_every_secret_key_a_pod_reads_is_one_step_3_creates():
    secrets = _created_secrets()
    assert set(secrets) == {"specops-postgres", "specops-s3", "specops-api-keys"}, secrets
    # the README's values on a value set whose credentials were values: those are cleared (one or the other)
    values = hs._merge(
        _step3_values(),
        {"postgresql": {"external": {"password": ""}}, "s3": {"accessKeyId": "", "secretAccessKey": ""}},
    )
    objects = hs.render(DEFAULT, values)
    assert hs.find(objects, "Secret") == [], "every credential comes from a Secret step 3 created"
    read = set()
    for obj in objects:
        for c in _containers(obj):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    read.add((ref["name"], ref["key"]))
    assert read, "no pod reads a Secret"
    created = {(name, key) for name, keys in secrets.items() for key in keys}
    assert read <= created, f"read but not created: {sorted(read - created)}"
    assert {name for name, _ in read} == set(secrets)  # and each Secret created is read


def _containers(obj: dict) -> list[dict]:
    try:
        spec = hs.pod_spec(obj)
    except (KeyError, TypeError, ValueError):
        return []
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def test_the_api_key_step_3_stores_is_the_one_step_8_sends():
    (keys,) = _created_secrets()["specops-api-keys"].values()
    tenant, key = split_key(keys)
    assert tenant == "team-a" and key == "$KEY"
    assert 'Authorization: Bearer $KEY"' in _step(8)
    assert re.search(r"^KEY=\$\(openssl rand -hex 16\)", "\n".join(_blocks(_step(3), "bash")), re.M)


def test_every_shell_variable_a_step_uses_is_set_before():
    """``$NAME`` in a bash block is set (``NAME=``) in it or an earlier one, or is a variable of the shell."""
    known = {"HOME", "PATH", "PWD", "USER"}
    for block in _blocks(WALKTHROUGH, "bash"):
        code = re.sub(r"'[^']*'", "", block)  # single-quoted text is not expanded
        for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", code):
            assert var in known or re.search(rf"^{var}=", code, re.M), f"${var} is used before it is set"
        known |= set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", code, re.M))


def test_the_gpu_path_reads_only_secrets_step_3_creates():
    """Step 5's GPU value set with step 3's values: every Secret a pod reads is one step 3 created, or one
    an operator the GPU set turns on makes itself (Strimzi's cluster CA and user secrets)."""
    gpu = hs.load_values(hs.CI_DIR / "gpu-keda-strimzi-values.yaml")
    values = hs._merge(gpu, _step3_values())
    objects = hs.render(None, values)
    created = {(name, key) for name, keys in _created_secrets().items() for key in keys}
    rendered = {o["metadata"]["name"] for o in hs.find(objects, "Secret")}
    read = {
        (ref["name"], ref["key"])
        for obj in objects
        for c in _containers(obj)
        for e in c.get("env", [])
        if (ref := e.get("valueFrom", {}).get("secretKeyRef")) is not None
    }
    missing = {(n, k) for n, k in read - created if n not in rendered and not n.startswith(f"{hs.RELEASE}-kafka")}
    assert not missing, f"the GPU path reads Secrets step 3 does not create: {sorted(missing)}"


def test_config_map_keys_a_pod_reads_are_rendered():
    for values_file in (DEFAULT, hs.CI_DIR / "gpu-keda-strimzi-values.yaml"):
        objects = hs.render(values_file, _step3_values())
        maps = {o["metadata"]["name"]: set(o.get("data", {})) for o in hs.find(objects, "ConfigMap")}
        for obj in objects:
            for c in _containers(obj):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref is not None:
                        assert ref["key"] in maps.get(ref["name"], set()), (values_file.name, ref)


# ---------------------------------------------------------------- names the README mentions
DEPLOY = README.parent


def _mentioned_paths() -> set[str]:
    """Repository paths the walkthrough names: `code` spans and links with a slash and a file-like name."""
    spans = set(re.findall(r"`([^`\s]+)`", WALKTHROUGH)) | set(re.findall(r"\]\(([^)#\s]+)", WALKTHROUGH))
    return {
        s for s in spans if "/" in s and re.fullmatch(r"\.?[\w.-]+(/[\w.-]+)*/?", s) and "." in s.split("/")[-1] + "/x."
    }


def test_every_file_the_walkthrough_names_exists():
    paths = {p for p in _mentioned_paths() if not p.startswith(("/", "autoscaling/", "checksum/", "ghcr.io/"))}
    assert {"docker/README.md", "helm/specops/ci/", "tests/deploy/test_walkthrough.py"} <= paths, paths
    for p in paths:
        if p.rstrip("/") in ("target", "draft", "embedder"):  # the models volume's layout, not the repository
            continue
        here = (DEPLOY / p, hs.REPO / p, hs.CHART_DIR / p)  # relative to deploy/, the repository or the chart
        assert any(x.exists() for x in here), f"the walkthrough names {p}, which does not exist"


def _value_names() -> set[str]:
    """Dotted chart value names in `code` spans (``models.fill.mode: s3`` names models.fill.mode)."""
    top = set(yaml.safe_load((hs.CHART_DIR / "values.yaml").read_text()))
    names = set()
    for span in re.findall(r"`([^`\n]+)`", WALKTHROUGH):
        for m in re.finditer(r"(?<![\w./-])([a-z][A-Za-z0-9]*(?:\.[A-Za-z0-9*]+)+)", span):
            if m.group(1).split(".")[0] in top:
                names.add(m.group(1))
    return names


def _schema_has(schema: dict, parts: list[str]) -> bool:
    node = schema
    for part in parts:
        props = node.get("properties", {})
        if part not in props:
            return False
        node = props[part]
    return True


def test_every_value_the_walkthrough_names_is_a_value_of_the_chart():
    import json

    names = _value_names()
    assert {"models.fill.mode", "serving.apiKeys.existingSecret", "models.existingClaim", "image.*"} <= names, names
    schema = json.loads((hs.CHART_DIR / "values.schema.json").read_text())
    for name in names:
        parts = [p for p in name.split(".") if p != "*"]
        assert _schema_has(schema, parts), f"the walkthrough names value {name}, which the chart does not have"


def test_the_packaged_chart_has_what_the_walkthrough_points_to(tmp_path):
    """`helm package` leaves out what .helmignore names: the value sets step 5 starts from must be in it."""
    import tarfile

    archive = hs.helm.package(hs.CHART_DIR, destination=tmp_path)
    with tarfile.open(archive) as tar:
        files = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    steps = "\n".join(_step(n) for n in (4, 5, 6))
    ci_files = set(re.findall(r"`([\w-]+-values\.yaml)`", steps))
    assert len(ci_files) >= 5, ci_files
    for name in ci_files:
        assert f"ci/{name}" in files, f"step 5's {name} is not in the packaged chart"
    assert {"values.schema.json", "values.yaml", "dashboards/specops.json", "templates/NOTES.txt"} <= files
    assert any(f.startswith("files/") for f in files)


# ---------------------------------------------------------------- the compose section
COMPOSE_SECTION = TEXT.split("### Compose", 1)[1].split("\n### ", 1)[0]


def test_the_compose_section_names_services_profiles_and_variables_compose_has():
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    env_example = (DEPLOY / "compose" / ".env.example").read_text()
    code = "\n".join(_blocks(COMPOSE_SECTION, "bash"))
    assert "cp .env.example .env" in code
    for var in re.findall(r"\b([A-Z][A-Z0-9_]{3,})\b", code.split("cp .env.example .env", 1)[1].splitlines()[0]):
        assert re.search(rf"^#?\s*{var}=", env_example, re.M), f"the README has you change {var}, not in .env.example"
    for line in code.splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] != ["docker", "compose"]:
            continue
        for i, w in enumerate(words):
            if w == "--profile":
                assert words[i + 1] in profiles, f"no compose profile {words[i + 1]}"
            if w == "--scale":
                assert words[i + 1].split("=")[0] in services, words[i + 1]
        if words[2:3] == ["build"]:
            assert all(s in services for s in words[3:] if not s.startswith("-")), line
    for name in re.findall(r"`(\w[\w-]*)`\s+service", COMPOSE_SECTION):
        assert name in services, f"the README names service {name}, which compose does not have"
