"""``specops serve``: one serving replica (the server itself is ``specops.cli.serve_runtime.Server``)."""

from __future__ import annotations

import argparse

from specops.cli.common import prose, set_threads
from specops.serving.http.config import add_arguments as add_serve_arguments

DESCRIPTION = prose(
    """
    One serving replica: POST /v1/completions and /v1/chat/completions (OpenAI request and response shapes,
    stream=true as server-sent events) plus the extension fields `speculation` {method, k} and `cluster`; GET
    /v1/models, /v1/clusters, /v1/policy, /healthz, /readyz, /metrics. Requests without `cluster` are routed by the
    registered router; API keys name tenants, whose past sessions LLMA keeps apart. Each cluster's draft follows its
    registry champion and is hot-swapped; every request is logged to the stream for the trainer. Settings come from
    the defaults, then --config FILE (TOML, top level or [serve]), then SPECOPS_SERVE_<SETTING> environment
    variables, then these flags. Run several replicas on one stream and registry by giving each its own --port.
    """
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API: speculative decoding with per-cluster drafts that follow the registry",
        description=DESCRIPTION,
    )
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file with any of the settings below")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from specops.cli.serve_runtime import Server
    from specops.serving.http.config import ServeConfig, overrides_from_args

    cfg = ServeConfig.load(args.config, overrides=overrides_from_args(args))
    set_threads(args.threads)
    import torch

    from specops.core.threads import reserve_for_compute

    # One OpenMP team, on the threads that run the target (specops.core.threads): the batcher and the loader
    reserve_for_compute(torch.get_num_threads())
    Server(cfg).run()
    return 0
