"""Weight averaging in online distillation: does the draft the trainer publishes lose to the
noise of its last updates on varied traffic?

On the real-text domain (``docs``) the online arm of ``benchmarks/osd.py`` reached only 0.57 of
the swept offline bound, against 0.82-0.86 on the templated domains, and its probe α went down
as well as up between checkpoints. This benchmark separates the learner from its noise: it
replays the online trainer's recipe on each domain's served stream (the cached target
continuations of ``benchmarks/osd.py``, forward KL at every output position, an update every 8
requests, one request in ten held out, AdamW with betas (0.9, 0.95), gradient clip 1) and keeps
exponential moving averages of the trained weights beside them (an average per decay, updated
after every update: ``avg = d·avg + (1-d)·weights``). Every ``--eval-every`` requests it measures
per-token α on the probe and on the template-disjoint probe for the trained weights and each
average; the offline bound (``--offline LR:EPOCHS``, the best of ``osd.py``'s sweep) is trained on
the same stream in the same run.

A recipe can also keep the trainer's replay buffer across updates (``LR:STEPS:POLICY:CAPACITY``,
e.g. ``1e-3:4:recent:64``: the trainer's ``--replay recent --capacity 64``), so that each request
trains several updates, as the offline arm's epochs revisit it.

The trainer itself is not run: no gate, no stream, no checkpoints; the optimiser steps are the
trainer's (``specops.trainer.data.draft_logits``, ``specops.trainer.losses.distill_loss``) on the same examples.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import osd  # noqa: E402
from benchmarks.common import cpu_model, environment, write_doc_section  # noqa: E402
from specops.core import draft_vocab  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.trainer.data import Example, draft_logits  # noqa: E402
from specops.trainer.losses import distill_loss  # noqa: E402
from specops.trainer.replay import POLICIES, ReplayBuffer, ReplayConfig  # noqa: E402
from specops.workloads.chat_workload import ALL_DOMAINS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- BEGIN osd_average (written by benchmarks/osd_average.py; edits inside are overwritten) -->"
END = "<!-- END osd_average -->"
HOLDOUT_EVERY = 10
"""One request in ten is held out, as the trainer's default ``holdout_every``."""
INTERVAL = 8
"""New requests per update, the trainer's default ``interval`` (the buffer cleared after each unless a
recipe names another replay policy)."""


def parse_recipes(spec: str) -> list[tuple[float, int, ReplayConfig]]:
    """``--recipes LR:STEPS[:POLICY:CAPACITY],...`` -> [(lr, steps per update, replay)]; the replay
    is the trainer's (``specops.trainer.replay``): ``clear`` (its default: each request trains one update)
    unless a policy is named, ``recent:64`` (the last 64 requests train every update)."""
    out = []
    for item in spec.split(","):
        parts = item.split(":")
        try:
            if len(parts) not in (2, 4):
                raise ValueError(item)
            lr, steps = float(parts[0]), int(parts[1])
            replay = ReplayConfig(parts[2], int(parts[3])) if len(parts) == 4 else ReplayConfig()
        except ValueError:
            raise SystemExit(
                f"--recipes {item!r}: give LR:STEPS or LR:STEPS:POLICY:CAPACITY (policy one of "
                f"{', '.join(POLICIES)}, capacity >= 1), e.g. 1e-3:4 or 1e-3:4:recent:64"
            ) from None
        if lr <= 0 or steps < 1:
            raise SystemExit(f"--recipes {item!r}: the rate must be > 0 and the steps >= 1")
        if replay.policy != "clear" and replay.capacity < INTERVAL:
            raise SystemExit(f"--recipes {item!r}: a kept buffer holds at least one update's {INTERVAL} requests")
        out.append((lr, steps, replay))
    return out


def recipe_label(rec: dict) -> str:
    """``lr 0.001, 4 steps`` (the buffer cleared after each update), or ``..., recent 64``."""
    label = f"lr {rec['lr']:g}, {rec['steps_per_update']} steps"
    if rec.get("replay", "clear") != "clear":
        label += f", {rec['replay']} {rec['capacity']}"
    return label


def parse_decays(spec: str) -> list[float]:
    out = [float(x) for x in spec.split(",") if x.strip()]
    if not out or any(not 0 < d < 1 for d in out):
        raise SystemExit(f"--decays {spec!r}: give decays in (0, 1), e.g. 0.9,0.95")
    return out


def parse_offline(spec: str) -> tuple[float, tuple[int, ...]]:
    """``--offline LR:E,E`` -> (lr, epochs)."""
    lr, _, epochs = spec.partition(":")
    try:
        out = float(lr), tuple(sorted({int(e) for e in epochs.split(",")}))
    except ValueError:
        raise SystemExit(f"--offline {spec!r}: give LR:EPOCHS[,EPOCHS], e.g. 1e-3:3,4") from None
    if out[0] <= 0 or not out[1] or min(out[1]) < 1:
        raise SystemExit(f"--offline {spec!r}: the rate must be > 0 and epochs >= 1")
    return out


class Learner:
    """The trained weights and their moving averages."""

    def __init__(self, draft: torch.nn.Module, lr: float, decays: list[float]) -> None:
        self.draft = draft
        self.model = copy.deepcopy(draft).train()
        self.vocab = draft_vocab.of(draft)
        self.model.get_input_embeddings().weight.requires_grad_(False)  # as the trainer (train_embeddings off)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95))
        self.averages = {d: [p.detach().clone() for p in self.params] for d in decays}

    def update(self, examples: list[Example], steps: int) -> None:
        """``steps`` AdamW steps over the whole buffer (position-weighted mean loss), then the averages."""
        positions = sum(e.num_positions for e in examples)
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=True)
            total = sum(
                distill_loss(draft_logits(self.model, e, self.vocab), e.target, "fkl") * e.num_positions
                for e in examples
            )
            (total / positions).backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
        self.average()

    def average(self) -> None:
        """``avg = d·avg + (1-d)·weights`` for every decay ``d``."""
        with torch.no_grad():
            for d, avg in self.averages.items():
                for a, p in zip(avg, self.params, strict=True):
                    a.mul_(d).add_(p.detach(), alpha=1 - d)

    def weights(self, arm: str) -> torch.nn.Module:
        """A copy of the draft with the arm's weights (``trained`` or ``avg<decay>``)."""
        values = [p.detach() for p in self.params] if arm == "trained" else self.averages[float(arm[3:])]
        state = self.model.state_dict()
        state.update(dict(zip(self.names, values, strict=True)))
        out = copy.deepcopy(self.draft)
        out.load_state_dict(state)
        return out.eval()

    def arms(self) -> list[str]:
        return ["trained", *(f"avg{d:g}" for d in self.averages)]


def measure(model: torch.nn.Module, probes: dict[str, list], args) -> dict:
    return {name: osd.probe(model, rows, args).alpha_token for name, rows in probes.items() if rows}


def run_domain(domain: str, args: argparse.Namespace) -> dict:
    """One domain: the static draft, each recipe's trained and averaged weights over the stream,
    the offline bound. Runs in its own process (``--jobs``)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    osd.set_domains([domain])
    model_dir = Path(args.model_dir)
    pair = osd.load_model_dir(model_dir, draft_dtype="float32")
    streams, probes, _, _, disjoint = osd.build_workload(pair, args, model_dir)
    stream = streams[domain]
    sets = {"probe": probes[domain], "disjoint": disjoint[domain]}
    out: dict = {"requests": len(stream), "static": measure(pair.draft, sets, args), "recipes": [], "offline": []}
    vocab = draft_vocab.of(pair.draft)
    for lr, steps, replay in args.recipe_list:
        learner = Learner(pair.draft, lr, args.decay_list)
        curve = [{"requests": 0, **{arm: out["static"] for arm in learner.arms()}}]
        buf: ReplayBuffer[Example] = ReplayBuffer(replay, domain)  # the trainer's buffer and release rule
        t0 = time.perf_counter()
        desc = f"{domain} lr {lr:g} x{steps}" + (
            "" if replay.policy == "clear" else f" {replay.policy} {replay.capacity}"
        )
        for j, s in enumerate(tqdm(stream, desc=desc, unit="req", leave=False), 1):
            if j % HOLDOUT_EVERY:  # one in ten held out, never trained on
                buf.add(osd.served_example(s, vocab, f"{domain}-{j}"))
            if buf.num_new == INTERVAL:  # an update every INTERVAL new requests, on what the buffer keeps
                learner.update(buf.items(), steps)
                buf.updated()
            if j % args.eval_every == 0 or j == len(stream):
                curve.append(
                    {"requests": j, **{arm: measure(learner.weights(arm), sets, args) for arm in learner.arms()}}
                )
        out["recipes"].append(
            {
                "lr": lr,
                "steps_per_update": steps,
                "replay": replay.policy,
                "capacity": replay.capacity,
                "curve": curve,
                "train_s": time.perf_counter() - t0,
            }
        )
    lr, epochs = args.offline_spec
    args.offline_batch = INTERVAL
    snaps = osd.offline_distill(pair.draft, stream, args, f"{domain}/offline lr {lr:g}", lr=lr, at=epochs)
    for e, model in snaps.items():
        out["offline"].append({"lr": lr, "epochs": e, **{"alpha": measure(model, sets, args)}})
    return out


def summarise(report: dict) -> dict:
    """Per domain and recipe: the final α of the trained weights and of each average on both
    probes, the gain over the static draft, and the fraction of the offline bound's gain.
    ``gain`` and ``fraction_of_bound`` compare, within the first recipe given (the trainer's
    default in the committed run), the trained weights with the best average."""
    out: dict = {"domains": list(report["domains"]), "per_domain": {}}
    best_gain, best_fraction = {}, {}
    for d, r in report["domains"].items():
        static = r["static"]
        bound = max(r["offline"], key=lambda o: o["alpha"]["probe"])
        bound_gain = bound["alpha"]["probe"] - static["probe"]
        rows = []
        for rec in r["recipes"]:
            final = rec["curve"][-1]
            for arm in (k for k in final if k != "requests"):
                gain = final[arm]["probe"] - static["probe"]
                row = {
                    "recipe": recipe_label(rec),
                    "arm": arm,
                    "alpha": final[arm]["probe"],
                    "gain": gain,
                    "fraction_of_bound": gain / bound_gain if bound_gain > 0 else None,
                }
                if "disjoint" in final[arm]:
                    row["alpha_disjoint"] = final[arm]["disjoint"]
                    row["gain_disjoint"] = final[arm]["disjoint"] - static["disjoint"]
                # the swing: how far the arm's probe α fell below its running best between evaluations
                seq = [c[arm]["probe"] for c in rec["curve"]]
                row["largest_drop"] = max(max(seq[: i + 1]) - v for i, v in enumerate(seq))
                rows.append(row)
        first = rows[0]["recipe"] if rows else None  # the summary compares within the first recipe (--recipes)
        averaged = [x for x in rows if x["arm"] != "trained" and x["recipe"] == first]
        trained = [x for x in rows if x["arm"] == "trained" and x["recipe"] == first]
        out["per_domain"][d] = {
            "static": static,
            "offline_bound": {"lr": bound["lr"], "epochs": bound["epochs"], **bound["alpha"]},
            "rows": rows,
        }
        if averaged and trained:
            best = max(averaged, key=lambda x: x["alpha"])
            best_gain[d] = {
                "recipe": first,
                "trained": trained[0]["gain"],
                "averaged": best["gain"],
                "decay": best["arm"],
                "trained_disjoint": trained[0].get("gain_disjoint"),
                "averaged_disjoint": best.get("gain_disjoint"),
            }
            best_fraction[d] = {
                "trained": trained[0]["fraction_of_bound"],
                "averaged": best["fraction_of_bound"],
                "decay": best["arm"],
            }
    out["gain"] = best_gain
    out["fraction_of_bound"] = best_fraction
    return out


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "| domain | recipe | weights | α probe | gain | α disjoint | gain | of offline bound | largest drop |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d, p in s["per_domain"].items():
        st = p["static"]
        lines.append(
            f"| {d} | – | static | {st['probe']:.3f} | – | {st.get('disjoint', float('nan')):.3f} | – | – | – |"
        )
        for r in p["rows"]:
            frac = "–" if r["fraction_of_bound"] is None else f"{r['fraction_of_bound']:.2f}"
            dj = f"{r['alpha_disjoint']:.3f} | {r['gain_disjoint']:+.3f}" if "alpha_disjoint" in r else "– | –"
            lines.append(
                f"| {d} | {r['recipe']} | {r['arm']} | {r['alpha']:.3f} | {r['gain']:+.3f} | {dj} | {frac} "
                f"| {r['largest_drop']:.3f} |"
            )
        b = p["offline_bound"]
        lines.append(
            f"| {d} | offline lr {b['lr']:g}, {b['epochs']} epochs | bound | {b['probe']:.3f} "
            f"| {b['probe'] - st['probe']:+.3f} | {b.get('disjoint', float('nan')):.3f} "
            f"| {b.get('disjoint', float('nan')) - st.get('disjoint', float('nan')):+.3f} "
            f"| {'1.00' if b['probe'] > st['probe'] else '–'} | – |"
        )
    return "\n".join(lines)


def doc_section(report: dict, table: str) -> str:
    env = report["environment"]
    return "\n".join(
        [
            BEGIN,
            "### Weight averaging in online distillation (`benchmarks/osd_average.py`)",
            "",
            f"Command: `{report['command']}` ({env['cpu_model']}, {report['config']['threads']} torch thread per "
            f"domain, {report['elapsed_s'] / 60:.0f} min). The online trainer's recipe replayed on each "
            "domain's served stream (the cached continuations of `benchmarks/osd.py`; no gate), with "
            "exponential moving averages of the weights (`avg<decay>`, updated after every update of 8 "
            "requests) beside the trained weights; per-token α after the whole stream on the probe and the "
            "template-disjoint probe. *Largest drop*: how far the arm's probe α fell below its own "
            "running best between evaluations. The bound is the offline arm trained in the same run.",
            "",
            table,
            "",
            "JSON: `benchmarks/out/osd_average.json`.",
            END,
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Full run: about 25 min per domain on one core (target continuations cached by "
        "`benchmarks/osd.py --domains D --prepare`, or made here on first use).",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument("--domains", default="docs,sql", help=f"domains, comma-separated ({', '.join(ALL_DOMAINS)})")
    p.add_argument("--requests", type=int, default=None, help="served requests per domain (default 1000; 120 quick)")
    p.add_argument("--probe", type=int, default=None, help="probe requests per domain (default 100; 40 quick)")
    p.add_argument(
        "--probe-disjoint", type=int, default=None, help="template-disjoint probe requests (default 100; 40 quick)"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 48; 32 quick)")
    p.add_argument("--k", type=int, default=osd.DEFAULT_K["draft"], help="draft tokens per step when probing")
    p.add_argument(
        "--recipes",
        default="1e-3:4",
        help="online recipes LR:STEPS (steps per update; the buffer cleared after each update, the trainer's "
        "default) or LR:STEPS:POLICY:CAPACITY (the trainer's replay policy: recent or reservoir, keeping CAPACITY "
        "requests across updates), comma-separated; 1e-3:4 is the trainer's default",
    )
    p.add_argument("--decays", default="0.8,0.9,0.95,0.98", help="moving-average decays per update")
    p.add_argument("--offline", default="1e-3:3,4", help="the offline bound: LR:EPOCHS (best of the epochs)")
    p.add_argument("--eval-every", type=int, default=None, help="probe every N requests (default 100; 40 quick)")
    p.add_argument("--jobs", type=int, default=1, help="domains run at once, one process each")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true", help="120 requests, 40 probe prompts, 32 new tokens")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="re-derive the summary, table and doc section from a saved --json report; runs nothing",
    )
    args = p.parse_args(argv)
    for name, full, quick in (
        ("requests", 1000, 120),
        ("probe", 100, 40),
        ("probe_disjoint", 100, 40),
        ("max_new_tokens", 48, 32),
        ("eval_every", 100, 40),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.domain_list = [d.strip() for d in args.domains.split(",") if d.strip()]
    unknown = [d for d in args.domain_list if d not in ALL_DOMAINS]
    if unknown or not args.domain_list:
        raise SystemExit(f"--domains: unknown {unknown or 'none given'}; choose from {', '.join(ALL_DOMAINS)}")
    args.recipe_list = parse_recipes(args.recipes)
    args.decay_list = parse_decays(args.decays)
    args.offline_spec = parse_offline(args.offline)
    # what benchmarks.osd's workload and probe read
    # what benchmarks.osd's workload reads: the same prompts as its runs, so its cached continuations serve
    args.router_texts, args.families, args.batch = (30 if args.quick else 100), "seen", 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return finish(json.loads(args.replot.read_text()), args.json or args.replot, args)
    started = time.perf_counter()
    command = " ".join(
        [".venv/bin/python", "benchmarks/osd_average.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    if args.jobs > 1 and len(args.domain_list) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = dict(
                zip(args.domain_list, pool.map(run_domain, args.domain_list, [args] * len(args.domain_list)))
            )
    else:
        results = {d: run_domain(d, args) for d in args.domain_list}
    report = {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": {**environment(), "cpu_model": cpu_model()},
        "config": {
            k: getattr(args, k)
            for k in ("requests", "probe", "probe_disjoint", "max_new_tokens", "k", "recipes", "decays", "offline")
        }
        | {"threads": args.threads, "interval": INTERVAL, "holdout_every": HOLDOUT_EVERY, "quick": args.quick},
        "domains": results,
        "elapsed_s": time.perf_counter() - started,
    }
    return finish(report, args.json, args)


def finish(report: dict, json_path: Path | None, args: argparse.Namespace) -> int:
    """The summary, the table (printed), the JSON and the doc section of a run or a ``--replot``."""
    report["summary"] = summarise(report)
    table = markdown(report)
    print(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1) + "\n")
    if not args.no_doc:
        write_doc_section(args.doc, BEGIN, END, doc_section(report, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
