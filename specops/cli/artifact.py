"""``specops artifact KIND ls|describe|promote|rollback|retain``: every artifact kind, one set of commands.

KIND is any kind of ``specops.registry.kinds`` (draft, router, datastore, kb, knnlm, sessions, policy). The
per-kind commands users know (``specops registry ls|promote|rollback|retain``, ``specops datastore
ls|promote``, ``specops router ls|promote``, ``specops kb ls``, ``specops knnlm ls``) are the same code:
their modules call :func:`add_ls`, :func:`add_promote`, :func:`add_rollback` and :func:`add_retain`
with their kind. What ``ls`` shows per kind is its :class:`Listing` in :data:`LISTINGS`; a kind without
one gets the default columns. The registry options every command shares (``--registry``,
``--stream``) are here too (:func:`add_registry_args`, :func:`open_registry`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specops.paths import data_dir, streams_url

NONE = ("none", "off", "")


# ---------------------------------------------------------------- the registry options
def registry_config(uri: str | None):
    """The registry at ``uri`` (``default``: $SPECOPS_REGISTRY_URI or SQLite under the data dir)."""
    from specops.registry import RegistryConfig

    return RegistryConfig.default(data_dir(), uri=None if uri in (None, "default") else uri)


def open_registry(uri: str | None, stream: str | None = None):
    """A RegistryStore that announces alias moves on ``stream``'s spec.events (unless ``none``)."""
    from specops.registry import RegistryStore

    on_change = None
    if stream and stream.lower() not in NONE:
        from specops.serving.fleet.events import EventPublisher
        from specops.streams import StreamConfig

        on_change = EventPublisher(StreamConfig.from_env(url=stream))
    return RegistryStore(registry_config(uri), on_change=on_change)


def add_registry_args(p: argparse.ArgumentParser, *, events: bool = True) -> None:
    p.add_argument(
        "--registry",
        default="default",
        metavar="URI",
        help="MLflow store: sqlite:////abs/mlflow.db, postgresql://user@host:5432/db or http://host:port "
        "(default: $SPECOPS_REGISTRY_URI, else SQLite under the data directory) "
        "(env: SPECOPS_REGISTRY_URI, SPECOPS_REGISTRY_ARTIFACTS, SPECOPS_DATA_DIR)",
    )
    if events:
        p.add_argument(
            "--stream",
            default=streams_url(),
            metavar="URL",
            help="announce promotions and rollbacks as ModelEvents on this stream's spec.events, so "
            "serving swaps at once ('none': serving picks the change up at its next poll) "
            "(default: %(default)s) (env: SPECOPS_STREAM_URL, else SPECOPS_DATA_DIR/streams)",
        )


def fmt(value, digits: int = 3) -> str:
    """A number for a table cell; ``-`` where there is none."""
    if value in (None, ""):
        return "-"
    try:
        return f"{float(value):.{digits}f}"
    except ValueError:
        return str(value)


# ---------------------------------------------------------------- what ls shows per kind
def _num(tag: str | None, digits: int = 0) -> float | int | None:
    """A metric tag (``%.6f`` text) as a number; None where absent or not a number."""
    try:
        value = round(float(tag), digits)
    except (TypeError, ValueError):
        return None
    return int(value) if digits == 0 else value


@dataclass(frozen=True)
class Column:
    """One field of a listed version: ``key`` in ``--json`` rows, ``header`` in the table (None: JSON only)."""

    key: str
    header: str | None
    value: Callable
    """``value(version)``: what the row holds."""
    digits: int | None = None
    """The table shows a number with this many digits (None: the text as it is)."""
    right: bool = False


def tag(name: str, header: str | None = None, *, key: str | None = None) -> Column:
    return Column(key or name, header, lambda v: v.tags.get(name, ""))


def num(name: str, header: str | None, digits: int = 0, *, key: str | None = None, shown: int | None = None) -> Column:
    """A metric tag, rounded to ``digits`` in the row; the table shows ``shown`` digits (default ``digits``)."""
    return Column(key or name, header, lambda v: _num(v.tags.get(name), digits), digits if shown is None else shown)


def metric(name: str, header: str | None, *, key: str, digits: int = 3, right: bool = False) -> Column:
    return Column(key, header, lambda v: v.metric(name), digits, right)


def _status(v) -> str:
    return "archived" if v.archived else "rolled back" if "rolled_back" in v.tags else ""


def _datastore_note(speed: float | None) -> str:
    """A datastore version's measured draft shape against target-only (its replayed speed)."""
    if speed is None:
        return "no measured shape (serves 3x10)"
    return "" if speed >= 1.0 else "no shape beats target-only"


VERSION = Column("version", "version", lambda v: v.version, right=True)
ALIASES = Column("aliases", "aliases", lambda v: ",".join(v.aliases))
CREATED = Column("created", "created", lambda v: time.strftime("%m-%d %H:%M:%S", time.localtime(v.created_ms / 1000)))
STATUS = Column("status", "status", _status)
LINEAGE = tag("lineage_offsets", "lineage offsets", key="lineage")


@dataclass(frozen=True)
class Listing:
    """What ``ls`` shows of a kind's versions."""

    title: str
    """Table title (``{uri}``: the registry's)."""
    columns: tuple[Column, ...]
    key: str = "key"
    """JSON key of the model's key (``cluster``, ``name``...); the model name itself for ``model``."""
    empty: str = "nothing registered yet"


LISTINGS: dict[str, Listing] = {
    "draft": Listing(
        "draft versions in {uri}",
        (
            metric("offline_acceptance_sampling", "offline α (sampling)", key="offline_sampling", right=True),
            metric("offline_acceptance_greedy", "offline α (greedy)", key="offline_greedy", right=True),
            tag("gate_decision", "gate", key="gate"),
            metric("live_acceptance", "live α", key="live", right=True),
            metric("live_requests", "live requests", key="live_requests", digits=0, right=True),
            STATUS,
            tag("parent_version", key="parent"),
            LINEAGE,
        ),
        key="model",
        empty="no draft versions registered yet (the trainer registers one per update)",
    ),
    "router": Listing(
        "router versions in {uri}",
        (
            Column("clusters", "clusters", lambda v: ",".join(v.clusters)),
            CREATED,
            Column("embedder", "embedder", lambda v: v.embedder_kind),
            metric("mean_distance", "mean distance", key="mean_distance", right=True),
            metric("agreement", "agreement", key="agreement", right=True),
            Column("records", "texts", lambda v: v.metric("records_used") or v.metric("num_texts"), 0, True),
            Column("gate", "gate", lambda v: {1.0: "passed", 0.0: "failed"}.get(v.metric("gate_passed"), "")),
            tag("parent_version", key="parent"),
            LINEAGE,
        ),
        key="",
        empty="no router registered yet: `specops router bootstrap` fits the first one",
    ),
    "datastore": Listing(
        "datastore versions",
        (
            num("num_entries", "entries", key="entries"),
            num("bytes_per_entry", "bytes/entry", 1, shown=0),
            num("mar", "MAR", 4, shown=3),
            num("live_mar", "live MAR", 4, shown=3),
            num("live_requests", "live requests"),
            tag("shape", "shape"),
            metric("shape_speed_vs_target", "vs target", key="speed_vs_target", digits=2, right=True),
            Column("note", "note", lambda v: _datastore_note(v.metric("shape_speed_vs_target"))),
            tag("source", "source"),
            Column("config", "config", lambda v: v.tags.get("config_hash", "")[:8]),
        ),
        key="cluster",
        empty="no datastore registered yet: `specops datastore build --register CLUSTER` builds one",
    ),
    "kb": Listing(
        "knowledge bases",
        (
            num("num_passages", "passages", key="passages"),
            tag("retrievers", "retrievers"),
            num("bytes_per_passage", "bytes/passage"),
            tag("embedder", "embedder"),
        ),
        key="name",
        empty="no knowledge base registered yet: `specops kb build --name NAME` builds one from this machine's docs",
    ),
    "knnlm": Listing(
        "kNN-LM datastore versions",
        (
            tag("searcher", "searcher"),
            num("num_entries", "entries", key="entries"),
            num("bytes_per_entry", "bytes/entry", 1, shown=0),
            num("build_s", "build s", 1),
            tag("source", "source"),
            Column("target", "target", lambda v: v.tags.get("target_sha256", "")[:8]),
        ),
        key="name",
        empty="no kNN-LM datastore registered yet: `specops knnlm build --name NAME` builds one",
    ),
    "sessions": Listing(
        "sessions versions",
        (
            num("num_outputs", "outputs"),
            num("num_tokens", "tokens"),
            num("hit_rate", "hit rate", 4, shown=3),
            tag("source", "source"),
            STATUS,
        ),
        key="cluster",
        empty="no sessions registered yet: `specops sessions rebuild` builds them from served outputs",
    ),
    "policy": Listing(
        "policy versions",
        (num("requests", "requests"), STATUS),
        key="",
        empty="no policy registered yet: `specops policy fit --register` fits one",
    ),
}


def listing(kind: str) -> Listing:
    return LISTINGS.get(kind) or Listing(f"{kind} versions", (STATUS,))


def rows(store, keys: list[str], *, include_archived: bool = True) -> list[dict]:
    """One dict per version of each key's model, as ``ls --json`` prints them (``served_by``: the
    replicas that last reported serving it, ``KindStore.report_served``)."""
    lst = listing(store.kind.name)
    out = []
    for key in keys:
        served = store.served(key)
        for v in store.versions(key, include_archived=include_archived):
            head = {"model": v.name} if lst.key == "model" else {lst.key: key} if lst.key else {}
            created = {} if any(c.key == "created" for c in lst.columns) else {"created": CREATED.value(v)}
            row = {**head, "version": v.version, "aliases": ALIASES.value(v), **created}
            row.update({c.key: c.value(v) for c in lst.columns})
            row["served_by"] = sorted(r for r, rep in served.items() if str(rep.get("serving")) == v.version)
            out.append(row)
    return out


def refusals(store, keys: list[str]) -> list[str]:
    """One line per replica whose last report says it refused a version (it serves another)."""
    lines = []
    for key in keys:
        for replica, rep in sorted(store.served(key).items()):
            if rep.get("refused"):
                at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(int(rep.get("at", 0))))
                lines.append(
                    f"{store.name(key)}: replica {replica} serves {rep.get('serving')} and refused version "
                    f"{rep['refused']} ({at} UTC)"
                )
    return lines


# ---------------------------------------------------------------- the commands
def cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    reg = open_registry(args.registry, None)
    store, lst = reg.artifact(args.kind), listing(args.kind)
    keys = [args.key] if args.key else store.keys() if store.kind.keyed else [""]
    found = rows(store, keys, include_archived=args.all)
    if args.json:
        for row in found:
            print(json.dumps(row))
        return 0
    head = [Column(lst.key, lst.key, None)] if lst.key else []
    created = [] if any(c.key == "created" for c in lst.columns) else [CREATED]
    columns = [c for c in (*head, VERSION, ALIASES, *created, *lst.columns) if c.header]
    table = Table(title=lst.title.format(uri=reg.cfg.uri))
    for c in columns:
        table.add_column(c.header, justify="right" if c.right else "left")
    served = any(r["served_by"] for r in found)
    if served:
        table.add_column("served by")
    for r in found:
        cells = [str(r[c.key]) if c.digits is None else fmt(r[c.key], c.digits) for c in columns]
        table.add_row(*cells, *([", ".join(r["served_by"]) or "-"] if served else []))
    Console(width=None if sys.stdout.isatty() else 220).print(table)
    if not found:
        print(lst.empty)
    for line in refusals(store, keys):
        print(line)
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    store = open_registry(args.registry, None).artifact(args.kind)
    print(json.dumps(store.describe(args.key or ""), indent=1, sort_keys=True))
    return 0


def check_promotable(store, key: str, version: str, model_dir: str | None) -> None:
    """What serving checks before it swaps a version in, run before the alias moves: every kind's
    files are fetched and their checksums verified; a draft is also validated against the target
    serving uses (``specops.serving.fleet.hotswap.validate_draft``: tokenizer, tensor shapes, vocabulary,
    finite logits). Raises the reason a replica would refuse it."""
    import tempfile

    v = store.get(key, version)
    with tempfile.TemporaryDirectory(prefix="specops-promote-") as tmp:
        dest = Path(tmp) / "v"
        store.fetch(v, dest)  # checksums against the manifest, the manifest against the version's tag
        if store.kind.name != "draft":
            return
        from transformers import AutoConfig

        from specops.core.errors import ModelConfigError
        from specops.core.models import load_tokenizer, tokenizer_hash
        from specops.serving.fleet.hotswap import validate_draft

        target = Path(model_dir) / "target" if model_dir else data_dir() / "models" / "target"
        if not (target / "config.json").is_file():
            raise ModelConfigError(
                f"no target model at {target} to validate the draft against: pass --model-dir (the directory "
                "serving loads, holding target/), or --no-validate to promote unchecked"
            )
        sha = tokenizer_hash(load_tokenizer(target))
        if v.tokenizer_sha256 and v.tokenizer_sha256 != sha:
            raise ModelConfigError(
                f"{v.name} version {version} was trained with tokenizer {v.tokenizer_sha256[:12]}, the "
                f"target at {target} uses {sha[:12]}"
            )
        vocab = int(AutoConfig.from_pretrained(target, local_files_only=True).vocab_size)
        validate_draft(dest, f"{v.name} version {version}", target_tokenizer_sha256=sha, target_vocab=vocab)


def cmd_promote(args: argparse.Namespace) -> int:
    from specops.core.errors import SpecOpsError
    from specops.registry import ArtifactIntegrityError

    store = open_registry(args.registry, args.stream).artifact(args.kind)
    if args.validate:
        try:
            check_promotable(store, args.key or "", args.version, getattr(args, "model_dir", None))
        except (SpecOpsError, ArtifactIntegrityError, ValueError, OSError) as exc:
            print(f"not promoted: {exc}", file=sys.stderr)
            return 2
    change = store.promote(args.key or "", args.version, reason=args.reason)
    print(f"{change.model_name}: champion {change.previous_version or 'none'} -> {change.version}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    store = open_registry(args.registry, args.stream).artifact(args.kind)
    change = store.rollback(args.key or "", reason=args.reason, to=args.to)
    assert change is not None
    print(f"{change.model_name}: champion {change.previous_version} -> {change.version} (rolled back)")
    return 0


def cmd_retain(args: argparse.Namespace) -> int:
    store = open_registry(args.registry, None).artifact(args.kind)
    keys = [args.key] if args.key else store.keys() if store.kind.keyed else [""]
    for key in keys:
        archived = store.retain(key, keep_last=args.keep, delete_artifacts=not args.keep_artifacts)
        print(f"{store.name(key)}: archived {', '.join(archived) if archived else 'nothing'}")
    return 0


# ---------------------------------------------------------------- the parsers (the per-kind commands use these too)
def _keyed(kind: str) -> bool:
    from specops.registry.kinds import KINDS

    return KINDS[kind].keyed


def _key_argument(q: argparse.ArgumentParser, kind: str, key_name: str | None) -> None:
    """The model's key: a positional (``cluster``, ``name``...) for a keyed kind, nothing for the router or policy."""
    if _keyed(kind):
        q.add_argument("key", metavar=(key_name or "key").upper(), help=f"the {kind}'s {key_name or 'key'}")
    else:
        q.set_defaults(key="")


def add_ls(sub, kind: str, *, key_flag: str | None = "--key", archived: bool = True, **kw) -> argparse.ArgumentParser:
    """``ls``: one row per version. ``archived``: hide archived versions unless ``--all`` (else list every one)."""
    q = sub.add_parser("ls", **{"help": f"list {kind} versions with their aliases and numbers", **kw})
    add_registry_args(q, events=False)
    if key_flag and _keyed(kind):
        q.add_argument(key_flag, dest="key", default=None, help=f"only this {key_flag.lstrip('-')}")
    else:
        q.set_defaults(key=None)
    if archived:
        q.add_argument("--all", action="store_true", help="include archived versions")
    else:
        q.set_defaults(all=True)
    q.add_argument("--json", action="store_true", help="one JSON object per version")
    q.set_defaults(func=cmd_ls, kind=kind)
    return q


def add_describe(sub, kind: str, *, key_name: str | None = None) -> argparse.ArgumentParser:
    q = sub.add_parser(
        "describe",
        help=f"a {kind} model as JSON: aliases, and every version's tags",
        description="Prints the registered model's aliases and, per version, its aliases, whether it "
        "is archived, and every tag (gate decision, metrics, lineage, promotion history).",
    )
    add_registry_args(q, events=False)
    _key_argument(q, kind, key_name)
    q.set_defaults(func=cmd_describe, kind=kind)
    return q


def add_promote(
    sub, kind: str, *, key_name: str | None = None, reason: str = "manual promotion", **kw
) -> argparse.ArgumentParser:
    q = sub.add_parser(
        "promote", **{"help": f"point the {kind}'s champion at a version (no gate: an operator's decision)", **kw}
    )
    add_registry_args(q)
    _key_argument(q, kind, key_name)
    q.add_argument("version")
    q.add_argument("--reason", default=reason, help="recorded on the version (default: %(default)s)")
    q.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="move the alias without first running the checks serving runs (fetch and verify the files; for a "
        "draft, load it against the target): a version serving refuses is then kept off by every replica",
    )
    if kind == "draft":
        q.add_argument(
            "--model-dir",
            default=None,
            metavar="DIR",
            help="the models directory serving loads (its target/ is what the draft is checked against) "
            "(default: the data directory's models/, as `specops serve`)",
        )
    q.set_defaults(func=cmd_promote, kind=kind)
    return q


def add_rollback(sub, kind: str, *, key_name: str | None = None, **kw) -> argparse.ArgumentParser:
    q = sub.add_parser("rollback", **{"help": "move champion back to the version it replaced", **kw})
    add_registry_args(q)
    _key_argument(q, kind, key_name)
    q.add_argument("--to", default=None, metavar="VERSION", help="roll back to this version instead")
    q.add_argument("--reason", default="manual rollback", help="recorded on the version")
    q.set_defaults(func=cmd_rollback, kind=kind)
    return q


def add_retain(sub, kind: str, *, key_flag: str = "--key", **kw) -> argparse.ArgumentParser:
    q = sub.add_parser("retain", **{"help": "archive old unaliased versions, keeping the newest N", **kw})
    add_registry_args(q, events=False)
    if _keyed(kind):
        q.add_argument(key_flag, dest="key", default=None, help=f"only this {key_flag.lstrip('-')} (default: all)")
    else:
        q.set_defaults(key=None)
    q.add_argument("--keep", type=int, default=20, help="newest versions kept per model (default: %(default)s)")
    q.add_argument("--keep-artifacts", action="store_true", help="tag archived but keep the files")
    q.set_defaults(func=cmd_retain, kind=kind)
    return q


def add_parser(sub) -> None:
    from specops.registry.kinds import KINDS

    p = sub.add_parser(
        "artifact",
        help="any registered artifact (draft, router, datastore, kb, knnlm, sessions, policy): list, describe, "
        "promote, roll back, retain",
        description="Every artifact kind is versioned the same way in the registry: one registered model per key "
        "(draft-<cluster>, datastore-<cluster>, kb-<name>...; router and policy have none), alias 'champion' is "
        "what serving uses, 'challenger' the latest candidate. Promotions and rollbacks are recorded on the "
        "versions and announced on spec.events. See docs/registry.md.",
    )
    ksub = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind in KINDS.values():
        k = ksub.add_parser(
            kind.name,
            help=kind.description.format(key="<key>").split(".")[0],
            description=kind.description.format(key="<key>"),
        )
        csub = k.add_subparsers(dest="artifact_command", required=True, metavar="SUBCOMMAND")
        add_ls(csub, kind.name)
        add_describe(csub, kind.name)
        add_promote(csub, kind.name)
        add_rollback(csub, kind.name)
        add_retain(csub, kind.name)
