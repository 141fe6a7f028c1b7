"""``specops sessions rebuild``: LLMA's past-sessions indexes, rebuilt from the served outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specops.cli.artifact import NONE, add_registry_args, open_registry
from specops.paths import models_dir


def sessions_rebuilder(stream: str, registry, tokenizer_dir: Path, *, min_new: int = 8, max_tokens: int = 65536):
    """The SessionIndexRebuilder ``specops train --sessions-rebuild-every`` schedules (and
    ``specops sessions rebuild`` runs once): stamped with the target's tokenizer hash."""
    from specops.core.models import load_tokenizer, tokenizer_hash
    from specops.core.sessions.cache import SessionCacheConfig
    from specops.streams import StreamConfig
    from specops.trainer.sessions import SessionIndexRebuilder, SessionRebuildConfig

    cfg = SessionRebuildConfig(min_new=min_new, cache=SessionCacheConfig(max_tokens=max_tokens))
    return SessionIndexRebuilder(
        StreamConfig.from_env(url=stream),
        registry,
        tokenizer_sha256=tokenizer_hash(load_tokenizer(Path(tokenizer_dir))),
        cfg=cfg,
    )


def cmd_rebuild(args: argparse.Namespace) -> int:
    from specops.core.errors import SpecOpsError

    if args.stream.lower() in NONE:
        raise SpecOpsError("sessions rebuild reads spec.generations: give --stream URL")
    rebuilder = sessions_rebuilder(
        args.stream,
        open_registry(args.registry, args.stream),
        Path(args.model_dir) / "target",
        min_new=args.min_new,
        max_tokens=args.max_tokens,
    )
    try:
        result = rebuilder.run_once()
        for _ in range(args.polls - 1):  # a Kafka group may need a few polls to be assigned its partitions
            if result.consumed:
                break
            result = rebuilder.run_once()
    finally:
        rebuilder.close()
    rows = [
        {
            "cluster": c,
            "version": result.versions[c],
            "outcome": outcome,
            "hit_rate": round(result.hit_rate[c][0], 4),
            "champion_hit_rate": None if result.hit_rate[c][1] is None else round(result.hit_rate[c][1], 4),
            "outputs": result.sizes[c][0],
            "tokens": result.sizes[c][1],
        }
        for c, outcome in sorted(result.clusters.items())
    ]
    if args.json:
        print(json.dumps({"consumed": result.consumed, "status": result.status, "clusters": rows}))
        return 0
    print(
        f"consumed {result.consumed} generations ({rebuilder.num_skipped} outputs too short to keep): {result.status}"
    )
    for r in rows:
        champ = "no champion" if r["champion_hit_rate"] is None else f"champion {r['champion_hit_rate']:.3f}"
        print(
            f"sessions-{r['cluster']}: version {r['version']} ({r['outputs']} outputs, {r['tokens']} tokens), "
            f"held-out copy hit rate {r['hit_rate']:.3f} vs {champ}: {r['outcome']}"
        )
    if rebuilder.waiting:
        print(
            f"waiting for {args.min_new} new outputs: {', '.join(rebuilder.waiting)} (not committed: read again "
            "by the next rebuild)"
        )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sessions",
        help="LLMA past sessions: rebuild each cluster's index of past outputs from spec.generations",
        description="A cluster's past sessions are the outputs of its recent requests, which LLMA copies from "
        "(cache-assisted generation). Serving adds every finished output to its own cache and seeds the cache from "
        "sessions-<cluster>@champion; the trainer rebuilds and versions them. See docs/llma.md.",
    )
    ssub = p.add_subparsers(dest="sessions_command", required=True, metavar="SUBCOMMAND")
    q = ssub.add_parser(
        "rebuild",
        help="one rebuild: register (and promote) sessions-CLUSTER for clusters with new outputs",
        description="Reads spec.generations on --stream (where promotions are announced too) in "
        "consumer group sessions-rebuild; for each cluster with --min-new new outputs keeps the newest "
        "that fit --max-tokens (after the champion's), scores the newest 10% held out (copy hit rate, "
        "candidate vs champion), registers sessions-CLUSTER and promotes it when not worse. Offsets are "
        "committed once every consumed output is in a registered version. `specops train "
        "--sessions-rebuild-every S` runs the same job on a schedule.",
    )
    add_registry_args(q)
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="bootstrap directory; target/'s tokenizer hash is stamped on the version (default: %(default)s) "
        "(env: SPECOPS_DATA_DIR)",
    )
    q.add_argument("--min-new", type=int, default=8, help="new outputs a cluster needs (default: %(default)s)")
    q.add_argument(
        "--max-tokens",
        type=int,
        default=65536,
        help="tokens kept per cluster: serving's session_cache_tokens (default: %(default)s)",
    )
    q.add_argument(
        "--polls", type=int, default=3, help="rebuild runs until one consumes records (default: %(default)s)"
    )
    q.add_argument("--json", action="store_true", help="print what it did as one JSON object")
    q.set_defaults(func=cmd_rebuild)
