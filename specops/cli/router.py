"""``specops router bootstrap|fit|ls|route|promote``: the prompt router in the registry."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from specops.cli.artifact import add_ls, add_promote, add_registry_args, open_registry
from specops.paths import models_dir

EMBEDDERS = ("minilm", "target")


def build_embedder(kind: str, model_dir: Path):
    """The ``kind`` embedder; ``target`` loads ``model_dir/target`` and its tokenizer."""
    from specops.core.embed import make_embedder

    if kind != "target":
        return make_embedder(kind)
    from specops.core.models import load_model, load_tokenizer

    target = Path(model_dir) / "target"
    return make_embedder(kind, model=load_model(target), tokenizer=load_tokenizer(target))


def train_refitter(
    stream: str,
    registry,
    model_dir: Path,
    *,
    tokenizer_dir: Path | None = None,
    embedder: str = "minilm",
    group: str = "router-refit",
):
    """The RouterRefitter ``specops train --router-refit-every`` schedules."""
    from specops.core.models import load_tokenizer
    from specops.streams import StreamConfig
    from specops.trainer.router_fit import RefitConfig, RouterRefitter

    tokenizer = load_tokenizer(Path(tokenizer_dir) if tokenizer_dir else Path(model_dir) / "target")
    return RouterRefitter(
        StreamConfig.from_env(url=stream),
        registry,
        tokenizer,
        build_embedder(embedder, model_dir),
        RefitConfig(group=group),
    )


def _load_champion(reg, version: str | None, model_dir: Path):
    from specops.core.router import Router

    routers = reg.artifact("router")
    rv = routers.get("", version) if version else routers.by_alias()
    if rv is None:
        return None
    with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
        routers.fetch(rv, Path(tmp) / "router")
        return Router.load(Path(tmp) / "router", build_embedder(rv.embedder_kind, model_dir), version=rv.version)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from specops.trainer.router_fit import bootstrap_router

    router = bootstrap_router(
        Path(args.model_dir),
        build_embedder(args.embedder, Path(args.model_dir)),
        per_domain=args.per_domain,
        seed=args.seed,
    )
    routers = open_registry(args.registry, args.stream).artifact("router")
    with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
        rv = routers.register(
            "",
            router.save(Path(tmp) / "router"),
            metrics=router.metrics,
            params={
                "source": "bootstrap",
                "model_dir": str(Path(args.model_dir).resolve()),
                "fitted_on": json.dumps(router.fitted_on),
                "seed": args.seed,
            },
        )
    champion = routers.by_alias()
    if champion is None or args.promote:
        routers.promote("", rv.version, reason="bootstrap router")
        state = "champion"
    else:
        state = f"challenger (champion stays {champion.version}; --promote replaces it)"
    print(
        f"router version {rv.version}: clusters {', '.join(router.clusters)} fitted on {router.fitted_on} "
        f"({router.embedder_kind} embedder), {state}"
    )
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from specops.core.models import load_tokenizer
    from specops.streams import StreamConfig
    from specops.trainer.router_fit import refit_from_stream

    reg = open_registry(args.registry, args.stream)
    champion = reg.artifact("router").by_alias()
    kind = args.embedder or (champion.embedder_kind if champion is not None else "minilm")
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else Path(args.model_dir) / "target")
    result = refit_from_stream(
        StreamConfig.from_env(url=args.stream),
        reg,
        tokenizer,
        build_embedder(kind, Path(args.model_dir)),
        group=args.group,
        min_records=args.min_records,
        k=args.k,
        min_agreement=args.min_agreement,
    )
    line = f"router refit: {result.status}; {result.consumed} records consumed, {result.buffered} prompts fitted"
    if result.version:
        line += f"; version {result.version} ({result.reason})"
    print(line)
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    from specops.core.errors import RouterError
    from specops.core.router import Router

    if args.router_dir:
        router = Router.load(Path(args.router_dir))  # checked before any embedder loads
        router = router.bind(build_embedder(router.embedder_kind, Path(args.model_dir)))
    else:
        router = _load_champion(open_registry(args.registry, None), args.version, Path(args.model_dir))
        if router is None:
            raise RouterError("no router champion in the registry: run `specops router bootstrap` first")
    decision = router.route(args.text)
    if args.json:
        print(
            json.dumps(
                {"cluster": decision.cluster, "distance": decision.distance, "router_version": decision.router_version}
            )
        )
    else:
        print(
            f"{decision.cluster}  (cosine distance {decision.distance:.3f}, router version {decision.router_version})"
        )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "router",
        help="the prompt router: fit the first one, refit from traffic, list versions, route a prompt",
        description="A request without a cluster is routed: its prompt is embedded (all-MiniLM-L6-v2, or the "
        "target's hidden states) and goes to the nearest of K centroids. The router is the registered model "
        "'router'; serving follows its alias 'champion' and hot-swaps it. See docs/routing.md.",
    )
    rsub = p.add_subparsers(dest="router_command", required=True, metavar="SUBCOMMAND")

    q = rsub.add_parser(
        "bootstrap",
        help="fit the first router on the bootstrap's training text (code, prose)",
        description="One centroid per bootstrap domain, the mean embedding of snippets of its "
        "training documents (never the held-out ones). Registers it, and promotes it when there is "
        "no champion yet (or with --promote).",
    )
    add_registry_args(q)
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="bootstrap directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument("--embedder", choices=EMBEDDERS, default="minilm", help="prompt embedder (default: %(default)s)")
    q.add_argument("--per-domain", type=int, default=200, help="snippets per domain (default: %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="snippet sampling seed (default: %(default)s)")
    q.add_argument("--promote", action="store_true", help="make it the champion even if one exists")
    q.set_defaults(func=cmd_bootstrap)

    q = rsub.add_parser(
        "fit",
        help="refit the router from spec.generations now (register, gate, promote, commit)",
        description="Consumes spec.generations in its own consumer group, refits seeded from the "
        "champion so cluster names stay, registers the new version and promotes it if it passes the "
        "gate; commits offsets only after registering.",
    )
    add_registry_args(q)
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="bootstrap directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer of the logged prompts (default: <--model-dir>/target)",
    )
    q.add_argument("--embedder", choices=EMBEDDERS, default=None, help="default: the champion's, else minilm")
    q.add_argument("--group", default="router-refit", help="consumer group (default: %(default)s)")
    q.add_argument("--min-records", type=int, default=50, help="prompts needed to refit (default: %(default)s)")
    q.add_argument("--k", type=int, default=None, help="centroids (default: the champion's clusters + new labels)")
    q.add_argument(
        "--min-agreement",
        type=float,
        default=0.5,
        help="promote only if this fraction of prompts keep their cluster (default: %(default)s)",
    )
    q.set_defaults(func=cmd_fit)

    add_ls(
        rsub,
        "router",
        archived=False,
        help="list router versions with aliases, clusters and fit metrics",
        description="One row per router version: aliases, clusters, embedder, mean cosine distance of the fitted "
        "prompts, agreement with the previous router, the gate, lineage offsets.",
    )

    q = rsub.add_parser(
        "route",
        help="print the cluster a prompt is routed to",
        description="Routes TEXT with the champion router (or --version, or a saved "
        "--router-dir) and prints the cluster, the cosine distance to its centroid and the router "
        "version.",
    )
    add_registry_args(q, events=False)
    q.add_argument("text", help="the prompt")
    q.add_argument("--version", default=None, help="router version (default: the champion)")
    q.add_argument("--router-dir", default=None, metavar="DIR", help="a router saved on disk instead of the registry")
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="for the target embedder (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument("--json", action="store_true", help='print {"cluster", "distance", "router_version"}')
    q.set_defaults(func=cmd_route)

    add_promote(
        rsub,
        "router",
        help="point the router's champion at a version (also how to roll back)",
        description="Moves alias champion of 'router' to VERSION and announces it on spec.events; serving swaps it in.",
    )
