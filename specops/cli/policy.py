"""``specops policy``: fit the ``auto`` policy's priors from spec.generations, report how it did,
and version the priors in the registry (kind ``policy``; serving loads ``policy@champion``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specops.cli.artifact import NONE, add_registry_args, open_registry


def read_generations(url: str):
    """Every decodable GenerationRecord on ``url``'s spec.generations (a read outside any group)."""
    from specops.streams import StreamConfig, open_stream
    from specops.streams.codec import decode
    from specops.streams.errors import RecordValidationError
    from specops.streams.records import GenerationRecord

    cfg = StreamConfig.from_env(url=url)
    with open_stream(cfg) as stream:
        if cfg.topics.generations not in stream.list_topics():
            return
        for msg in stream.read(cfg.topics.generations):
            try:
                rec = decode(msg.value)
            except RecordValidationError:
                continue  # the trainer's consumers dead-letter these; a report skips them
            if isinstance(rec, GenerationRecord):
                yield rec


def cmd_fit(args: argparse.Namespace) -> int:
    from specops.core.errors import SpecOpsError
    from specops.trainer.policy_fit import PolicyFitter

    if args.stream.lower() in NONE:
        raise SpecOpsError("policy fit reads spec.generations: give --stream URL")
    registry = open_registry(args.registry, args.stream) if args.register else None
    fitter = PolicyFitter(read_generations(args.stream), registry, max_trials=args.max_trials, promote=args.promote)
    registered = fitter.run_once()  # registers (and promotes) only with a registry and auto requests to fit
    used = fitter.used
    out = {"requests": used, "clusters": {c: r.to_dict() for c, r in sorted(fitter.report.items())}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(fitter.priors, indent=1))
        out["priors"] = str(args.out)
    out.update(registered)
    if args.json:
        print(json.dumps(out))
        return 0
    if not used:
        print(f"no 'auto' requests on {args.stream}'s spec.generations yet: nothing to fit")
        return 0
    print(f"{used} auto requests")
    for cluster, r in out["clusters"].items():
        share = ", ".join(f"{m} {100 * p:.0f}%" for m, p in r["step_share"].items())
        acc = ", ".join(f"{m} {a:.3f}" for m, a in r["acceptance"].items()) or "-"
        print(f"  {cluster}: {r['requests']} requests; steps: {share}; acceptance: {acc}")
    if args.out:
        print(f"priors written to {args.out} (serve --auto-priors {args.out})")
    if "version" in out:
        print(f"registered policy version {out['version']}" + (" and promoted it" if out.get("promoted") else ""))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "policy",
        help="the auto policy: fit its priors from logged decisions, report how it chose",
        description="speculation.method 'auto' chooses the drafter and k per step from measured acceptance and "
        "costs (docs/auto.md). Serving logs its decisions with every generation; this fits the per-cluster "
        "acceptance priors new replicas start from.",
    )
    psub = p.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    q = psub.add_parser(
        "fit",
        help="read spec.generations, report per cluster, write/register the priors",
        description="Reads every GenerationRecord of an 'auto' request on --stream (outside any "
        "consumer group: nothing is committed), sums its acceptance counts per cluster, method "
        "(llma per match length) and temperature bucket, prints per cluster the share of steps "
        "each method got and its acceptance, and writes the priors (--out) and/or registers them "
        "as the 'policy' kind (--register; --promote makes it policy@champion, which serving loads "
        "at start when --auto-priors is not given).",
    )
    add_registry_args(q)
    q.add_argument("--out", help="write the priors JSON here (serve --auto-priors PATH)")
    q.add_argument("--register", action="store_true", help="register the priors as a new 'policy' version")
    q.add_argument("--promote", action="store_true", help="with --register: make it the champion")
    q.add_argument("--max-trials", type=float, default=1000.0, help="bound on each key's counts (default: %(default)s)")
    q.add_argument("--json", action="store_true", help="print the report as one JSON object")
    q.set_defaults(func=cmd_fit)
