"""``deploy/README.md``'s walkthrough as written: the Secrets its step 3 creates are the ones, and
hold the keys, that every pod the chart renders with step 3's values reads (issue 58: the README
created ``password`` and ``keys`` where the chart reads ``postgres-password`` and ``api-keys``),
and the shell variables its steps use are set in an earlier step."""

from __future__ import annotations

import re
import shlex

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
