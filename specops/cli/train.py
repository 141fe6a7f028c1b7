"""``specops train``: online distillation, one draft per cluster, registered and promoted through the gate.

The scheduled jobs beside it (router refits, datastore and past-sessions rebuilds) run in the same process."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

from specops.cli.common import add_model_dir, fail, positive_int, prose, set_threads
from specops.core.device import add_arguments as add_placement_arguments
from specops.paths import data_dir, streams_url

log = logging.getLogger("specops")

DESCRIPTION = prose(
    """
    Consumes MissRecords from the stream as a consumer group, keeps a replay buffer per cluster and, every
    --interval requests of a cluster, takes gradient steps on that cluster's draft with the chosen GKD loss at the
    logged rejected positions (OSD Algorithm 1). Expected acceptance on held-out records is logged before and after
    each update. Drafts, optimiser state and buffers are checkpointed under --out before offsets are committed, so a
    killed trainer loses nothing and resumes where it was.
    """
)

# the scheduled jobs that register artifacts: (flag, what it registers)
REGISTERING_JOBS = (
    ("router_refit_every", "--router-refit-every registers routers"),
    ("datastore_rebuild_every", "--datastore-rebuild-every registers datastores"),
    ("sessions_rebuild_every", "--sessions-rebuild-every registers past-sessions indexes"),
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="online distillation: consume spec.misses and keep one draft per cluster aligned with the target",
        description=DESCRIPTION,
    )
    for add in (
        _add_inputs_args,
        _add_distillation_args,
        _add_placement_args,
        _add_running_args,
        _add_gate_args,
        _add_jobs_args,
    ):
        add(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from specops.streams import StreamConfig
    from specops.trainer.online.trainer import OnlineTrainer
    from specops.trainer.ranks import launched_world

    set_threads(args.threads)
    # Ctrl-C / SIGINT is the trainer's graceful stop (checkpoint, commit, exit 0). A process started from a
    # non-interactive shell with `&` inherits SIGINT ignored, and Python then installs no handler: put it back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = _online_config(args)
    base = Path(args.draft) if args.draft else Path(args.model_dir) / "draft"
    target = None
    # an explicit --target is always loaded: records of an external engine (vLLM) need it at any positions
    if args.sampling != "teacher" or args.positions == "all" or args.target:
        target = Path(args.target) if args.target else Path(args.model_dir) / "target"
        if args.draft and not args.target:  # a draft of its own: its target is not the bootstrap's
            target = Path(args.draft).parent / "target"
        if not (target / "config.json").is_file():
            why = f"--sampling {args.sampling}" if args.sampling != "teacher" else "--positions all (the default)"
            return fail(
                "train",
                f"{why} needs the target model, and {target} has none: pass --target DIR "
                "(or --positions rejected, which learns from the stream alone)",
            )
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
        return fail(
            "train", f"{world} ranks were launched (WORLD_SIZE), but only --backend deepspeed trains on several ranks"
        )
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
        log.info("metrics on :%d/metrics", args.metrics_port)
    promoter = _promoter(args, base)
    for flag, registers in REGISTERING_JOBS:
        if getattr(args, flag) and promoter is None:
            return fail("train", f"{registers}: it needs a registry, not --registry none")
    jobs = _jobs(args, promoter)
    trainer = OnlineTrainer(
        StreamConfig.from_env(url=args.stream), base, Path(args.out), cfg, target=target, promoter=promoter
    )
    try:
        consumed = _run(args, trainer, jobs)
    except KeyboardInterrupt:
        consumed = None
        log.info("interrupted; everything committed is checkpointed")
    finally:
        trainer.close()
        for job in jobs.values():
            if job is not None:
                job.close()
    for cluster, st in sorted(trainer.clusters.items()):
        ev = st.last_eval.get("after", {})
        print(
            f"cluster {cluster}: draft v{st.version}, {st.updates} updates, {st.records_trained} requests, "
            f"{st.positions_trained} positions; held-out acceptance {ev.get('sampling', float('nan')):.3f}"
        )
    if consumed is not None:
        print(f"consumed {consumed} records; checkpoints in {args.out}")
    return 0


def _online_config(args: argparse.Namespace):
    from specops.trainer.online.trainer import OnlineConfig
    from specops.trainer.replay import ReplayConfig

    return OnlineConfig(
        group=args.group,
        interval=args.interval,
        loss=args.loss,
        beta=args.beta,
        tau=args.tau,
        lr=args.lr,
        steps_per_update=args.steps,
        average_decay=args.average_decay,
        replay=ReplayConfig(policy=args.replay, capacity=args.capacity),
        holdout_every=args.holdout_every,
        backend=args.backend,
        sampling=args.sampling,
        mix=args.mix,
        positions=args.positions,
        poll_records=args.poll_records,
        train_embeddings=args.train_embeddings,
        device=args.device,
        dtype=args.dtype,
        deepspeed_zero_stage=args.zero_stage,
        max_loaded_clusters=args.max_loaded_clusters,
        max_clusters=args.max_clusters,
    )


def _promoter(args: argparse.Namespace, base: Path):
    """The gate that registers each update's draft and promotes it; None with ``--registry none``."""
    if args.registry.lower() in ("none", "off"):
        return None
    from specops.cli.artifact import open_registry
    from specops.trainer.promote import PromoteConfig, Promoter

    pcfg = PromoteConfig(
        margin=args.gate_margin,
        metric=args.gate_metric,
        z=args.gate_z,
        min_positions=args.gate_min_positions,
        window=args.gate_window,
        window_s=args.gate_window_s,
        fresh=args.gate_fresh,
        register_every=args.register_every,
        keep_versions=args.keep_versions,
    )
    registry = open_registry(args.registry, args.stream)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else None
    promoter = Promoter(registry, base, Path(args.out), pcfg, tokenizer_dir=tokenizer_dir)
    log.info(
        "registering drafts in %s (gate: %s acceptance, margin %s, on the newest %s held-out requests%s%s)",
        registry.cfg.uri,
        pcfg.metric,
        pcfg.margin,
        pcfg.window or "all",
        f" of the last {pcfg.window_s:g} s" if pcfg.window_s else "",
        f" and {pcfg.fresh} fresh training requests scored before training" if pcfg.fresh else "",
    )
    return promoter


def _jobs(args: argparse.Namespace, promoter) -> dict:
    """The scheduled jobs asked for, by the keyword TrainerScheduler takes them under (None: not asked for)."""
    target_dir = Path(args.target) if args.target else Path(args.model_dir) / "target"
    jobs = {"router_refitter": None, "datastore_rebuilder": None, "sessions_rebuilder": None}
    if args.router_refit_every:  # refits the prompt router from spec.generations
        from specops.cli.router import train_refitter
        from specops.core.errors import RouterError

        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else None
        try:
            jobs["router_refitter"] = train_refitter(
                args.stream,
                promoter.registry,
                Path(args.model_dir),
                embedder=args.router_embedder,
                tokenizer_dir=tokenizer_dir,
            )
        except RouterError as exc:  # the embedder is built now, at start: say which setting asked for it
            raise RouterError(
                f"--router-refit-every (train.toml: router_refit_every) refits the prompt router on the "
                f"{args.router_embedder} embedder, which cannot load. {exc}. To do without it: --router-embedder "
                'target (router_embedder = "target") refits on the target\'s hidden states; router_refit_every = 0 '
                "refits no router"
            ) from None
    if args.datastore_rebuild_every:  # rebuilds each cluster's DReSD datastore from spec.generations
        from specops.core.models import load_model, load_tokenizer, tokenizer_hash
        from specops.streams import StreamConfig
        from specops.trainer.datastores import DatastoreRebuilder, RebuildConfig

        jobs["datastore_rebuilder"] = DatastoreRebuilder(
            StreamConfig.from_env(url=args.stream),
            promoter.registry,
            load_model(target_dir, device=args.device),
            tokenizer_sha256=tokenizer_hash(load_tokenizer(target_dir)),
            cfg=RebuildConfig(min_new=args.datastore_min_new),
        )
    if args.sessions_rebuild_every:  # rebuilds each cluster's LLMA past-sessions index
        from specops.cli.sessions import sessions_rebuilder

        jobs["sessions_rebuilder"] = sessions_rebuilder(
            args.stream, promoter.registry, target_dir, min_new=args.sessions_min_new
        )
    return jobs


def _run(args: argparse.Namespace, trainer, jobs: dict) -> int:
    """Train until idle or ``--max-records``: a plain loop, or APScheduler jobs on a persistent job store."""
    if not args.schedule and all(job is None for job in jobs.values()):
        return trainer.run(max_idle_s=args.idle_exit, max_records=args.max_records)
    from specops.trainer.schedule import ScheduleConfig, TrainerScheduler, default_jobstore_url

    if args.verbose < 1:
        logging.getLogger("apscheduler").setLevel(logging.WARNING)  # no "Running job" line per tick
    scfg = ScheduleConfig(
        jobstore_url=args.jobstore or default_jobstore_url(args.out),
        tick_seconds=args.tick_seconds,
        load_signal=args.load_signal,
        load_threshold=args.load_threshold,
        router_refit_s=args.router_refit_every,
        datastore_rebuild_s=args.datastore_rebuild_every,
        sessions_rebuild_s=args.sessions_rebuild_every,
    )
    scheduler = TrainerScheduler(trainer, scfg, **jobs)
    return scheduler.run_forever(max_idle_s=args.idle_exit, max_records=args.max_records)


def _add_inputs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file of these options (keys are the long option names with _ for -, at the top level "
        "or under [train]); flags given on the command line win (the Helm chart and compose mount one)",
    )
    p.add_argument(
        "--stream",
        default=streams_url(),
        metavar="URL",
        help="stream to consume (default: %(default)s) (env: SPECOPS_STREAM_URL, else SPECOPS_DATA_DIR/streams)",
    )
    add_model_dir(p, "bootstrap dir whose draft/ seeds new clusters")
    p.add_argument("--draft", default=None, help="draft model directory seeding new clusters (overrides --model-dir)")
    p.add_argument(
        "--out",
        default=str(data_dir() / "trainer"),
        help="checkpoint directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    p.add_argument("--group", default="trainer", help="consumer group (default: %(default)s)")


def _add_distillation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=int, default=8, help="update a cluster every I requests (default: %(default)s)")
    p.add_argument(
        "--loss", choices=("fkl", "rkl", "jsd"), default="fkl", help="distillation loss (default: %(default)s)"
    )
    p.add_argument("--beta", type=float, default=0.5, help="JSD mixture weight (default: %(default)s)")
    p.add_argument("--tau", type=float, default=1.0, help="softmax temperature (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="optimiser steps per update (default: %(default)s)")
    p.add_argument(
        "--average-decay",
        type=float,
        default=0.95,
        metavar="D",
        help="publish an exponential moving average of the trained weights, avg = D*avg + (1-D)*weights after "
        "every update, instead of the weights themselves; 0 turns it off. 0.95 learned more on every served "
        "chat stream measured (benchmarks/osd_average.py); it lags a drift by about 1/(1-D) updates "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sampling",
        choices=("teacher", "student", "mixed"),
        default="teacher",
        help="where the loss applies (OSD 4.1): teacher = the logged rejected positions against the logged "
        "target distributions (needs only the stream); student / mixed = continuations of the logged "
        "prompts sampled from the draft / from mix*p + (1-mix)*q, scored by the target model, which the "
        "trainer then loads (--target) (default: %(default)s)",
    )
    p.add_argument(
        "--positions",
        choices=("rejected", "all"),
        default="all",
        help="teacher sampling: train at the logged rejected positions only (OSD Algorithm 1), or at every "
        "output position, the target's distribution there recomputed by one target forward per request "
        "(loads --target) (default: %(default)s; chosen by benchmarks/osd.py --grid, docs/trainer.md)",
    )
    p.add_argument(
        "--mix", type=float, default=0.5, help="--sampling mixed: target weight of the mixture (default: %(default)s)"
    )
    p.add_argument(
        "--target",
        default=None,
        help="target model directory for student/mixed sampling and --positions all (default: <--model-dir>/target)",
    )
    p.add_argument(
        "--replay",
        choices=("clear", "recent", "reservoir"),
        default="clear",
        help="replay buffer eviction: clear after each update (OSD), most recent N, or reservoir sample "
        "(default: %(default)s)",
    )
    p.add_argument("--capacity", type=int, default=32, help="replay buffer size per cluster (default: %(default)s)")
    p.add_argument(
        "--train-embeddings",
        action="store_true",
        help="also train the draft's token embeddings (default: frozen, as the bootstrap trains it)",
    )
    p.add_argument(
        "--holdout-every", type=int, default=10, help="hold out 1 request in N for evaluation (default: %(default)s)"
    )
    p.add_argument(
        "--max-loaded-clusters",
        type=positive_int,
        default=8,
        metavar="N",
        help="most clusters whose draft and optimiser are in memory; the least recently used idle one is "
        "unloaded (its checkpoint kept) and reloaded when its records come (default: %(default)s)",
    )
    p.add_argument(
        "--max-clusters",
        type=positive_int,
        default=64,
        metavar="N",
        help="most clusters the trainer creates in all (those under --out count); records of a further "
        "cluster go to the dead-letter topic (default: %(default)s)",
    )
    p.add_argument(
        "--poll-records",
        type=int,
        default=256,
        help="records consumed per pass; each pass ends by registering the newest checkpoints and "
        "committing, so fewer means promotions reach serving sooner (default: %(default)s)",
    )


def _add_placement_args(p: argparse.ArgumentParser) -> None:
    add_placement_arguments(
        p,
        dtype_help="precision the drafts' weights train in (float32 is the safe default; "
        "bfloat16 halves memory on a GPU)",
    )
    p.add_argument(
        "--backend",
        choices=("torch", "deepspeed"),
        default="torch",
        help="optimiser backend: plain PyTorch, or DeepSpeed ZeRO (gloo on the CPU, NCCL on GPUs). Under "
        "DeepSpeed's launcher (deepspeed --num_gpus N --no_local_rank --module specops train ...) rank 0 "
        "consumes, evaluates, checkpoints and registers, and every rank computes the gradients of its "
        "share of each update's examples (data parallel) (default: %(default)s)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2),
        default=2,
        help="--backend deepspeed: ZeRO stage (1: optimiser state partitioned over the ranks, 2: and the "
        "gradients) (default: %(default)s)",
    )


def _add_running_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics (updates and their time per cluster, held-out acceptance, ticks, records "
        "consumed, skipped steps) on "
        "0.0.0.0:PORT/metrics (rank 0 only) (default: off)",
    )
    p.add_argument("--idle-exit", type=float, default=None, metavar="S", help="stop after S seconds without records")
    p.add_argument(
        "--max-records",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after consuming exactly N records (the last pass polls only what is left; "
        "everything consumed is trained on and committed)",
    )
    p.add_argument(
        "--schedule",
        action="store_true",
        help="run as scheduled jobs (a distillation tick, an evaluation every 60s) kept in a persistent "
        "job store, so the schedule survives restarts; ticks are skipped while serving is busy",
    )
    p.add_argument(
        "--jobstore",
        default=None,
        metavar="URL",
        help="--schedule job store: sqlite:///path or postgresql://user@host:5432/db "
        "(default: sqlite:///<--out>/schedule.sqlite)",
    )
    p.add_argument(
        "--tick-seconds", type=float, default=5.0, help="--schedule: seconds between ticks (default: %(default)s)"
    )
    p.add_argument(
        "--load-signal",
        default=None,
        metavar="PATH",
        help='--schedule: JSON file {"load": float, "time": epoch} written by serving; a tick is skipped '
        "while load > --load-threshold; a signal older than 30s is ignored (default: never skip)",
    )
    p.add_argument(
        "--load-threshold",
        type=float,
        default=0.8,
        help="--schedule: serving load above which ticks are skipped (default: %(default)s)",
    )


def _add_gate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry",
        default="default",
        metavar="URI",
        help="register each update's draft here as 'challenger' and promote it to 'champion' through the "
        "gate before committing offsets: sqlite:////abs/mlflow.db, postgresql://user@host/db, "
        "http://host:port, 'default' ($SPECOPS_REGISTRY_URI, else SQLite under the data directory) or "
        "'none' (checkpoints only) (default: %(default)s) (env: SPECOPS_REGISTRY_URI, SPECOPS_REGISTRY_ARTIFACTS)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="directory with the tokenizer files registered with each draft (default: the base draft's)",
    )
    p.add_argument(
        "--gate-margin",
        type=float,
        default=0.005,
        help="promote only if held-out acceptance beats the champion's by this much (default: %(default)s)",
    )
    p.add_argument(
        "--gate-metric",
        choices=("served", "sampling", "greedy"),
        default="served",
        help="what the gate compares: served = greedy agreement at every output position of held-out "
        "greedy requests, paired per request, and the win must exceed --gate-z standard errors; sampling / "
        "greedy = expected acceptance at the held-out rejected positions, which favours any draft other "
        "than the one that served them (default: %(default)s)",
    )
    p.add_argument(
        "--gate-z",
        type=float,
        default=1.645,
        help="served: standard errors the win must exceed (default: %(default)s, one-sided 95%%)",
    )
    p.add_argument(
        "--gate-min-positions",
        type=int,
        default=32,
        help="held-out positions needed before the gate decides (default: %(default)s)",
    )
    p.add_argument(
        "--gate-window",
        type=int,
        default=16,  # PromoteConfig.window (not imported here: the CLI starts without torch)
        metavar="N",
        help="judge each candidate on the cluster's newest N held-out requests, so that a draft that followed "
        "a drift in the cluster's traffic is not scored on what the traffic left (with --holdout-every 10, 16 "
        "span the last ~160 requests); 0 = every held-out request the trainer keeps, its newest 256 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--gate-fresh",
        type=int,
        default=32,  # PromoteConfig.fresh
        metavar="N",
        help="served gate: also pair the learning draft with the champion on the cluster's newest N training "
        "requests, each scored by the draft just before it trained on it (test-then-train), so a draft that "
        "follows a drift is promoted within tens of requests; the candidate must still not be worse beyond noise "
        "on the held-out requests of the same period; 0 = held-out requests only (default: %(default)s)",
    )
    p.add_argument(
        "--gate-window-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also leave out held-out requests logged more than this long ago; 0 = no age limit (default: %(default)s)",
    )
    p.add_argument("--register-every", type=int, default=1, help="register every N-th update (default: %(default)s)")
    p.add_argument(
        "--keep-versions",
        type=int,
        default=20,
        help="archive unaliased versions beyond the newest N per cluster, 0 = never (default: %(default)s)",
    )


def _add_jobs_args(p: argparse.ArgumentParser) -> None:
    _add_every(
        p,
        "datastore-rebuild",
        "rebuild each cluster's DReSD datastore from its new spec.generations (the "
        "target over them in batches, z-norm and PCA refitted, the index), register it and promote it when "
        "its held-out MAR beats the champion's (a scheduled job: implies --schedule; needs a registry)",
    )
    p.add_argument(
        "--datastore-min-new",
        type=int,
        default=32,
        help="new generations a cluster needs before a rebuild (default: %(default)s)",
    )
    _add_every(
        p,
        "sessions-rebuild",
        "rebuild each cluster's LLMA past-sessions index (its newest outputs within "
        "65536 tokens) from its new spec.generations, register it as sessions-<cluster> and promote it "
        "when its held-out copy hit rate is not worse than the champion's (a scheduled job: implies "
        "--schedule; needs a registry; no model runs). The index mixes every tenant's outputs: only "
        "servers with session_sharing = 'shared' follow it",
    )
    p.add_argument(
        "--sessions-min-new",
        type=int,
        default=8,
        help="new outputs a cluster needs before its past sessions are rebuilt (default: %(default)s)",
    )
    _add_every(
        p,
        "router-refit",
        "refit the prompt router from spec.generations, register it and promote it "
        "through its gate (a scheduled job: implies --schedule; needs a registry)",
    )
    p.add_argument(
        "--router-embedder",
        choices=("minilm", "target"),
        default="minilm",
        help="prompt embedder of refitted routers: all-MiniLM-L6-v2, or the mean of the target's last "
        "hidden state (<--model-dir>/target) (default: %(default)s)",
    )


def _add_every(p: argparse.ArgumentParser, job: str, what: str) -> None:
    """``--JOB-every S``: run the scheduled job every S seconds; off when not given or 0."""
    p.add_argument(
        f"--{job}-every", type=float, default=None, metavar="S", help=f"every S seconds {what}; 0 = off (default: off)"
    )
