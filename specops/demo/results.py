"""``specops demo``'s closing measurements and console summary: target-only vs the static draft vs
each cluster's champion on never-served prompts, the registry's versions, and the α table."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from specops.demo.report.data import DemoRun, SpeedRow
from specops.serving.plan import plain_generate
from specops.workloads.prompts import Prompt

if TYPE_CHECKING:
    from specops.demo.run import DemoConfig


def compare_speed(
    console: Console, server, unseen: dict[str, list[Prompt]], cfg: DemoConfig, *, before: bool = False
) -> list[SpeedRow]:
    """Target-only vs the static draft vs each cluster's champion vs ``auto``, greedy, one
    request at a time.

    On prompts of the cluster's domain that the workload never served (their token ids as
    the server would see them: a chat prompt rendered with the chat template): what the
    champion gained there it learned about the domain, not about the prompts it saw.

    ``auto`` decodes as the server decodes a request that names no method: the replica's own
    policy, the cluster's current draft and datastore, and the copy sources its past sessions
    hold (read, not added to: no arm copies from another arm's output). ``before``: target-only and ``auto``
    only, before any traffic (the static draft, a policy with no history)."""
    from tqdm import tqdm

    from specops.core.models import ModelPair
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams
    from specops.serving.proposers.catalogue import ProposerResources

    state = server.state
    pair, tok = state.pair, state.pair.tokenizer
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_tokens)
    sessions = getattr(state.node, "sessions", None)
    scope = (
        "anonymous" if state.cfg.retrieval.session_sharing == "tenant" else ""
    )  # the demo's one tenant (no api keys)
    out: list[SpeedRow] = []
    clusters = sorted(set(unseen) & (set(state.known_clusters.names()) | set(state.follower.slots)))
    for cluster in clusters:
        if before or cluster not in state.follower.slots:
            model, version = pair.draft, "base"
        else:
            handle = state.follower.slot(cluster).current()
            model, version = handle.model, handle.version
        arms = {"target-only": (pair.draft, "target", "")}
        if not before:
            arms["static draft"] = (pair.draft, "draft", "base")
            arms["online draft"] = (model, "draft", version)
        arms["auto"] = (model, "auto", version)
        datastore = state.datastores.current(cluster) if state.datastores is not None else None
        if not before and datastore is not None and datastore.datastore is not None:  # rebuilt from its traffic
            arms["dresd (served traffic)"] = (pair.draft, "dresd", datastore.version)
        past = sessions.index(cluster, scope) if sessions is not None else None
        results = {a: [] for a in arms}
        what = "before the traffic" if before else "after"
        for prompt in tqdm(
            unseen[cluster][: cfg.eval_prompts], desc=f"speed {cluster} ({what})", unit="prompt", leave=False
        ):
            ids = list(prompt.token_ids)
            for arm, (draft, method, _) in arms.items():  # interleaved: machine noise hits every arm alike
                engine = SpecEngine(ModelPair(target=pair.target, draft=draft, tokenizer=tok))
                resources = ProposerResources(
                    pair=engine.pair,
                    cluster=cluster,
                    datastore=datastore.datastore if method in ("dresd", "auto") and datastore is not None else None,
                    reference_indexes=(past,) if method == "auto" and past is not None else (),
                    policy=state.policy if method == "auto" else None,
                )
                results[arm].append(plain_generate(engine, ids, params, method=method, resources=resources))
        ref = [r.token_ids for r in results["target-only"]]
        for arm, (_, method, version) in arms.items():
            res = results[arm]
            drafted = sum(r.stats.num_drafted for r in res)
            accepted = sum(r.stats.num_accepted for r in res)
            rejected = [getattr(r.stats, "num_rejected_steps", None) for r in res]  # None: an engine without it
            tried = None if None in rejected else accepted + sum(rejected)
            out.append(
                SpeedRow(
                    cluster=cluster,
                    method=arm,
                    draft_version=version,
                    tokens_per_s=statistics.median(r.stats.tokens_per_s for r in res),
                    acceptance=accepted / drafted if drafted else float("nan"),
                    num_prompts=len(res),
                    identical=[r.token_ids for r in res] == ref,
                    alpha=accepted / tried if drafted and tried else float("nan"),
                    **(_auto_share(res) if method == "auto" else {}),
                )
            )
    return out


def _auto_share(results) -> dict:
    """``auto``'s share of steps on the draft model over ``results``, and the α of those steps."""
    methods = [r.stats.policy.get("methods", {}) for r in results]
    steps = sum(n["steps"] for m in methods for n in m.values())
    d = [m.get("draft", {}) for m in methods]
    acc = sum(x.get("accepted", 0) for x in d)
    tried = acc + sum(x.get("rejected_steps", 0) for x in d)
    return {
        "draft_share": sum(x.get("steps", 0) for x in d) / steps if steps else float("nan"),
        "draft_alpha": acc / tried if tried else float("nan"),
    }


def registry_versions(registry) -> list[dict]:
    rows = []
    drafts = registry.artifact("draft")
    for cluster in drafts.keys():
        for v in drafts.versions(cluster):
            t = v.tags
            rows.append(
                {
                    "cluster": cluster,
                    "version": v.version,
                    "aliases": list(v.aliases),
                    "registered_at": t.get("registered_at", ""),
                    "gate_decision": t.get("gate_decision", ""),
                    "gate_reason": t.get("gate_reason", "")[:160],
                    "offline acceptance": t.get("gate_candidate_acceptance", t.get("sampling", "")),
                    "live_acceptance": t.get("live_acceptance", ""),
                    "archived": v.archived,
                }
            )
    return rows


def print_summary(
    console: Console, report_dir: Path, index: Path, ui_url: str, registry_uri: str, run: DemoRun
) -> None:
    import json

    from rich import box
    from rich.table import Table

    summary = json.loads((report_dir / "summary.json").read_text())
    table = Table(
        title="closed loop per cluster (α: the OSD per-token α, by halves of its requests)", box=box.SIMPLE_HEAD
    )
    # halves, not fixed windows of 100: a cluster of the default run serves about 50 requests
    for col in (
        "cluster",
        "reqs",
        "α\n1st→2nd",
        "promoted",
        "draft\n÷target",
        "auto drafts\n1st→2nd",
        "auto÷target\nbefore→after",
    ):
        table.add_column(col, justify="left" if col == "cluster" else "right", no_wrap=True)

    def f(x, spec=".3f", suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    for name, c in sorted(summary["clusters"].items()):
        table.add_row(
            name,
            str(c["requests"]),
            f"{f(c['alpha_first_half'], '.2f')}→{f(c['alpha_last_half'], '.2f')}",
            f"{c['promotions']} (v{c['draft_versions'][-1]})" if c["promotions"] else "0",
            f(c.get("speedup_vs_target"), ".2f", "x"),
            f"{f(c.get('auto_draft_share_first_half'), '.0%')}→{f(c.get('auto_draft_share_last_half'), '.0%')}",
            f"{f(c.get('auto_speedup_vs_target_before'), '.2f', 'x')}→{f(c.get('auto_speedup_vs_target'), '.2f', 'x')}",
        )
    console.print(table)
    console.print(f"[dim]{summary['alpha_definition']}[/]")
    if any("auto_draft_share_first_half" in c for c in summary["clusters"].values()):
        console.print(
            "[dim]promoted: promotions (the final champion); draft ÷ target: the champion's tokens/s (method draft) "
            "over target-only's; auto drafts: the default method's share of steps on the draft model over the served "
            "traffic, first half → second; auto ÷ target: its tokens/s over target-only's on never-served prompts, "
            "before the traffic → after. "
            "Acceptance, the static draft and DReSD are in the report.[/]"
        )
    console.print(f"failed requests: {summary['failed_requests']} of {summary['requests']}")
    console.print(f"[bold]Report:[/] {index.resolve()}  (summary: {(report_dir / 'summary.json').resolve()})")
    console.print(
        f"[bold]MLflow UI:[/] {ui_url} while the demo runs; afterwards: specops registry ui --registry {registry_uri}"
    )
