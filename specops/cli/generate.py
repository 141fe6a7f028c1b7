"""``specops generate``: decode one prompt with one method and print it (or JSON)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specops.cli.common import add_model_dir, set_threads
from specops.serving.proposers.catalogue import METHODS, describe, method_spec

log = logging.getLogger("specops")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate one completion with one method and print it (or JSON)",
        description="Decode one prompt. Methods: " + describe() + ". "
        "At temperature 0 every method returns exactly the target's greedy tokens.",
    )
    add_model_dir(p, "directory with target/ and draft/")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="decoding method (default: %(default)s, as the server's default_method)",
    )
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (default: %(default)s); it reproduces a sample under a named method, "
        "not under auto, which picks each step's drafter from measured timings",
    )
    p.add_argument(
        "--k", type=int, default=None, help="tokens drafted per step (default: 3 for draft, 10 for pld and dresd)"
    )
    p.add_argument(
        "--datastore",
        default=None,
        metavar="DIR",
        help="a saved DReSD datastore for --method dresd (specops datastore build --out DIR)",
    )
    p.add_argument("--n-drafts", type=int, default=None, help="rows per step for --method dresd (default: 3)")
    p.add_argument(
        "--draft-dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="precision the draft runs in; the target runs in float32. auto: float32 and bfloat16 are timed "
        "when the draft loads and the faster is kept (default: %(default)s) (env: SPECOPS_DRAFT_DTYPE forces "
        "what auto means)",
    )
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"} as one JSON line')
    p.add_argument(
        "--stream",
        default=None,
        metavar="URL",
        help="also log the request (MissRecord + GenerationRecord) to this stream, "
        "e.g. local://./.specops/streams or kafka://127.0.0.1:9092",
    )
    p.add_argument("--cluster", default="default", help="cluster id the logged records carry (default: %(default)s)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from specops.core.models import load_model_dir
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams
    from specops.serving.fleet.stream_logger import RequestMeta
    from specops.serving.plan import plain_generate

    set_threads(args.threads)
    pair = load_model_dir(Path(args.model_dir), draft_dtype=args.draft_dtype)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    prompt_ids = pair.tokenizer(args.prompt, add_special_tokens=False)["input_ids"] if args.prompt else []
    logger = None
    if args.stream:
        from specops.serving.fleet.stream_logger import StreamLogger

        logger = StreamLogger(args.stream, vocab_size=pair.vocab_size)
    try:
        draft_model = "bootstrap-draft" if method_spec(args.method).artifact == "draft" else ""
        meta = RequestMeta(cluster=args.cluster, draft_model=draft_model)
        resources = _resources(args, pair)
        engine = SpecEngine(pair, logger=logger)
        result = plain_generate(
            engine,
            prompt_ids,
            params,
            args.method,
            k=args.k,
            n_drafts=args.n_drafts or 0,
            meta=meta,
            resources=resources,
        )
    finally:
        if logger is not None:
            logger.close(timeout_s=30)
            if logger.stats.published:
                log.info("logged request %s to %s", meta.request_id, args.stream)
            else:
                log.warning("could not log the request to %s (dropped: %s)", args.stream, logger.stats.dropped)
    _print_result(args, result)
    return 0


def _resources(args: argparse.Namespace, pair):
    """What the method needs beyond the models: a saved datastore (dresd), a calibrated policy (auto)."""
    from specops.serving.proposers.catalogue import ProposerResources

    resources = None
    if args.datastore:  # dresd: a saved datastore (specops datastore build --out DIR)
        from specops.core.datastore import Datastore

        store = Datastore.load(Path(args.datastore))
        store.check_fits(pair.target, pair.vocab_size)
        resources = ProposerResources(pair=pair, cluster=args.cluster, datastore=store)
    if args.method == "auto":  # one request: the policy starts from the models' measured costs
        from dataclasses import replace

        from specops.core.auto_policy import AutoPolicy
        from specops.serving.proposers.auto import calibrate

        policy = AutoPolicy(seed=args.seed)
        calibrate(policy, pair)
        base = resources or ProposerResources(pair=pair, cluster=args.cluster)
        resources = replace(base, policy=policy)
    return resources


def _print_result(args: argparse.Namespace, result) -> None:
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
        return
    s = result.stats
    print(args.prompt + (result.text or ""))
    print(
        f"\n[{s.method}] {s.num_generated} tokens in {s.time_s['total']:.3f}s ({s.tokens_per_s:.1f} tok/s), "
        f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_forward:.2f} tokens/target forward, "
        f"finish={s.finish_reason}",
        file=sys.stderr,
    )
    if s.policy:
        mix = ", ".join(
            f"{m} {v['steps']} steps ({v['accepted']}/{v['drafted']} accepted)" for m, v in s.policy["methods"].items()
        )
        print(f"[auto] {mix}", file=sys.stderr)
