"""The ``specops`` command line.

Subcommands import their packages lazily so ``specops --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from specops.paths import models_dir, streams_url

log = logging.getLogger("specops")

METHODS = ("target", "draft", "pld")


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _threads(n: int | None) -> None:
    import torch

    torch.set_num_threads(n or min(os.cpu_count() or 1, 8))


# ---------------------------------------------------------------- bootstrap
def cmd_bootstrap(args: argparse.Namespace) -> int:
    from trainer.bootstrap import run

    _threads(args.threads)
    manifest = run(Path(args.out), tiny=args.tiny, seed=args.seed, force=args.force)
    metrics = manifest.get("metrics") or {}
    print(f"models ready in {args.out}" + (" (tiny, random weights)" if manifest.get("tiny") else ""))
    if metrics:
        print(json.dumps(metrics, indent=2))
    return 0


# ---------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> int:
    from serving.engine import SpecEngine
    from serving.models import load_model_dir
    from serving.types import SamplingParams

    _threads(args.threads)
    pair = load_model_dir(Path(args.model_dir))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    prompt_ids = pair.tokenizer(args.prompt, add_special_tokens=False)["input_ids"] if args.prompt else []
    logger = None
    if args.stream:
        from serving.stream_logger import StreamLogger

        logger = StreamLogger(args.stream, vocab_size=pair.vocab_size)
    try:
        from serving.stream_logger import RequestMeta

        meta = RequestMeta(cluster=args.cluster, draft_model="bootstrap-draft" if args.method == "draft" else "")
        result = SpecEngine(pair, logger=logger).generate(prompt_ids, params, method=args.method, k=args.k, meta=meta)
    finally:
        if logger is not None:
            logger.close(timeout_s=30)
            if logger.stats.published:
                log.info("logged request %s to %s", meta.request_id, args.stream)
            else:
                log.warning("could not log the request to %s (dropped: %s)", args.stream, logger.stats.dropped)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
    else:
        s = result.stats
        print(args.prompt + (result.text or ""))
        print(
            f"\n[{s.method}] {s.num_generated} tokens in {s.time_s['total']:.3f}s ({s.tokens_per_s:.1f} tok/s), "
            f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_forward:.2f} tokens/target forward, "
            f"finish={s.finish_reason}",
            file=sys.stderr,
        )
    return 0


# ---------------------------------------------------------------- streams
def cmd_streams_inspect(args: argparse.Namespace) -> int:
    from specops.streams_cli import inspect

    return inspect(args.url, args.topic, limit=args.limit, tail=args.tail, group=args.group, as_json=args.json)


def cmd_streams_topics(args: argparse.Namespace) -> int:
    from specops.streams_cli import topics

    return topics(args.url)


# ---------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from specops.demo import run_demo

    _threads(args.threads)
    stream = None if args.no_stream else args.stream
    return run_demo(Path(args.model_dir), num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, k=args.k,
                    stream=stream)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specops",
        description="Speculative-decoding drafters that learn online. "
        "Run `specops COMMAND --help` for each command's options.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors in the log")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores, max 8)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "bootstrap",
        help="train the default tokenizer, target and draft from text on this machine",
        description="Train a byte-level BPE tokenizer, a small Llama target and a 1-layer draft distilled "
        "from it, from the Python standard library (code) and English text under /usr/share (prose). "
        "Held-out files of each domain are recorded in manifest.json and never trained on. "
        "Takes about 10-15 minutes on 2 cores; skipped when a complete bootstrap already exists.",
    )
    p.add_argument("--out", default=str(models_dir()), help="output directory (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="random tiny models in seconds, for tests and quick checks")
    p.add_argument("--seed", type=int, default=0, help="seed for the split, the tokenizer and training")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete bootstrap exists")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser(
        "generate",
        help="generate one completion with one method and print it (or JSON)",
        description="Decode one prompt. Methods: target = target-only decoding (the reference); "
        "draft = speculative decoding with the draft model; pld = prompt-lookup decoding. "
        "At temperature 0 every method returns exactly the target's greedy tokens.",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="directory with target/ and draft/ (default: %(default)s)")
    p.add_argument("--method", choices=METHODS, default="draft", help="decoding method (default: %(default)s)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: 4 for draft, 10 for pld)")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"} as one JSON line')
    p.add_argument("--stream", default=None, metavar="URL",
                   help="also log the request (MissRecord + GenerationRecord) to this stream, "
                   "e.g. local://./.specops/streams or kafka://127.0.0.1:9092")  # fmt: skip
    p.add_argument("--cluster", default="default", help="cluster id the logged records carry (default: %(default)s)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "streams",
        help="look into a stream: its topics, and the records of one topic",
        description="Read-only tools for the streams serving logs to and the trainer consumes. "
        "URL is local:///abs/path, local://./relative/path or kafka://host:port[,host:port]; "
        "Kafka TLS/SASL settings come from SPECOPS_STREAM_* environment variables.",
    )
    streams_sub = p.add_subparsers(dest="streams_command", required=True, metavar="SUBCOMMAND")
    q = streams_sub.add_parser(
        "inspect",
        help="print a readable summary of the records of one topic, dead letters included",
        description="Reads TOPIC outside any consumer group (commits nothing) and prints one line per record: "
        "partition, offset, time, key, type, size and a summary (request, acceptance, rejected positions; or "
        "the source and reason of a dead letter). Records that fail validation are shown as INVALID with the "
        "reason. Ends with totals per type and per cluster, and the group's lag with --group.",
    )
    q.add_argument("url", help="stream URL")
    q.add_argument("topic", help="topic, e.g. spec.misses, spec.generations, spec.events, spec.deadletter")
    q.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N records of each partition")
    q.add_argument("--limit", type=int, default=50, help="rows to print, 0 = all (default: %(default)s)")
    q.add_argument("--group", default=None, help="also show this consumer group's committed offsets and lag")
    q.add_argument("--json", action="store_true", help="one JSON object per record instead of a table")
    q.set_defaults(func=cmd_streams_inspect)
    q = streams_sub.add_parser("topics", help="list topics with partitions and record counts",
                               description="Lists every topic at URL with its partitions and records.")  # fmt: skip
    q.add_argument("url", help="stream URL")
    q.set_defaults(func=cmd_streams_topics)

    p = sub.add_parser(
        "demo",
        help="bootstrap if needed, then decode held-out prompts with every method and print a stats table",
        description="The main job on embedded defaults: bootstraps the models if they are not cached, decodes "
        "held-out code and prose prompts greedily with each method, checks every output equals target-only "
        "decoding, and prints tokens/s, acceptance and speedup per method and domain.",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="model directory (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per domain (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion (default: %(default)s)")
    p.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: 4 for draft, 10 for pld)")
    p.add_argument("--stream", default=streams_url(), metavar="URL",
                   help="log every request (MissRecord + GenerationRecord, cluster = domain) here (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="do not log requests to a stream")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    from serving.errors import SpecOpsError
    from streams.errors import StreamError

    try:
        return int(args.func(args) or 0)
    except (SpecOpsError, StreamError) as err:
        print(f"specops {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
