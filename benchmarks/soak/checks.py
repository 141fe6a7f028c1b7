"""The soak's checks (``benchmarks/faults.py`` is the command, its docstring defines what they count):
tenant isolation on the last server, failed requests against the kill windows, accepted records
lost, duplicated versions, outputs against target-only, and the analysis that joins them."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import requests
import torch
from tqdm import tqdm

from benchmarks.soak.stack import (
    BOGUS_CLUSTERS,
    CLUSTER,
    COMPONENTS,
    DECOYS,
    TENANTS,
    TIE_TOL,
    TOPICS,
    Attempt,
    Stack,
    Window,
    make_prompt,
    metric_clusters,
    read_stream,
)
from specops.serving.plan import plain_generate


def check_isolation(stack: Stack, args) -> dict:
    """Tenant scope and bounded cluster names on the last server, once the load has stopped (issue 34):

    - ``/readyz`` (no key) names no cluster;
    - ``BOGUS_CLUSTERS`` requests naming made-up clusters each get a 400 naming ``cluster``, and no
      made-up name becomes a ``cluster`` label on ``/metrics``;
    - the extraction replay: tenant A generates a sampled output with LLMA (it enters A's past
      sessions; its token ids are read from its GenerationRecord in the stream); A's probe with 8
      tokens of it and ``speculation: {method: "llma", n: 8}`` finds it (the positive control), the
      identical probe of E (a key that sent nothing else) must find nothing (``hits_sessions`` 0, and
      ``reference_tokens`` 0: not even the cache's size), and E's guess-and-extend attack from a
      known 8-token prefix must recover no token, while A's does.
    Probes ask for 4 tokens, under the past-sessions minimum of 8, so they never enter a cache."""
    url = stack.server_url
    alice, eve = f"Bearer {TENANTS['alice']}", f"Bearer {TENANTS['eve']}"
    rng = random.Random(f"{args.seed}-isolation")
    n_probe = 0

    def post(key: str, rid: str, **body) -> requests.Response:
        return requests.post(
            url + "/v1/completions",
            json={"model": "specops", "cluster": CLUSTER, **body},
            headers={"Authorization": key, "X-Request-Id": rid},
            timeout=(5, args.request_timeout_s),
        )

    def probe(key: str, tail: list[int]) -> dict:
        nonlocal n_probe
        n_probe += 1
        r = post(
            key,
            f"isolation-probe-{n_probe}",
            prompt=tail,
            max_tokens=4,
            temperature=0,
            speculation={"method": "llma", "n": 8},
        )
        r.raise_for_status()
        return r.json()["speculation"]["llma"]

    def extend(key: str, known: list[int], truth: list[int]) -> int:
        """Guess the token after ``known`` among decoys, keep the one whose 8-gram hits past sessions."""
        recovered: list[int] = []
        for right in truth:
            guesses = [c for c in rng.sample(range(1, args.vocab), DECOYS) if c != right] + [right]
            hits = [c for c in guesses if probe(key, (known + recovered + [c])[-8:])["hits_sessions"]]
            if len(hits) != 1 or hits[0] != right:
                break
            recovered.append(right)
        return len(recovered)

    out: dict = {"readyz_names_cluster": CLUSTER in requests.get(url + "/readyz", timeout=10).text}
    before = metric_clusters(url)
    codes = []
    for j in range(BOGUS_CLUSTERS):
        r = post(
            alice,
            f"isolation-bogus-{j}",
            prompt=make_prompt(args.seed, 10_000, j, args.vocab),
            max_tokens=2,
            temperature=0,
            cluster=f"made-up-{j}",
        )
        param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
        codes.append((r.status_code, param))
    after = metric_clusters(url)
    out["bogus_clusters_sent"] = BOGUS_CLUSTERS
    out["bogus_clusters_refused"] = sum(c == (400, "cluster") for c in codes)
    out["bogus_cluster_answers"] = sorted({f"{c} {p}" for c, p in codes})
    out["metric_cluster_labels"] = {"before": sorted(before), "after": sorted(after)}
    out["made_up_labels"] = sorted(c for c in after if c.startswith("made-up"))

    secret: list[int] | None = None
    for attempt in range(3):  # a sampled output long and varied enough to probe
        rid = f"isolation-secret-{attempt}"
        r = post(
            alice,
            rid,
            prompt=make_prompt(args.seed, 10_001, attempt, args.vocab),
            max_tokens=32,
            temperature=1.0,
            seed=7 + attempt,
            speculation={"method": "llma"},
        )
        if r.status_code != 200:
            continue
        deadline = time.monotonic() + 30
        ids = None
        while ids is None and time.monotonic() < deadline:  # the logger publishes in the background
            ids = next(
                (
                    row.get("output_ids")
                    for row in read_stream(stack.stream_url).get("spec.generations", [])
                    if row["rid"] == rid
                ),
                None,
            )
            if ids is None:
                time.sleep(0.5)
        if ids and len(ids) >= 20 and len(set(ids[:12])) >= 8:
            secret = ids
            break
    out["secret_tokens"] = len(secret) if secret else 0
    if secret:
        window = secret[8:16]
        mine, theirs = probe(alice, window), probe(eve, window)
        out["control_hits"] = int(mine["hits_sessions"])
        out["cross_tenant_hits"] = int(theirs["hits_sessions"])
        out["cross_tenant_reference_tokens"] = int(theirs["reference_tokens"])
        out["control_tokens_recovered"] = extend(alice, secret[:8], secret[8:12])
        out["cross_tenant_tokens_recovered"] = extend(eve, secret[:8], secret[8:12])
    out["probes"] = n_probe
    return out


def isolation_violations(iso: dict, records: dict) -> list[str]:
    """What the isolation checks found wrong (``check_isolation``), and any stream record of a cluster
    other than the configured one."""
    bad = []
    if iso.get("readyz_names_cluster"):
        bad.append("/readyz (no key) names a cluster")
    if iso.get("bogus_clusters_refused") != iso.get("bogus_clusters_sent"):
        bad.append(
            f"requests naming made-up clusters were not all 400 naming `cluster`: {iso.get('bogus_cluster_answers')}"
        )
    if iso.get("made_up_labels"):
        bad.append(f"made-up clusters became metric labels: {iso['made_up_labels'][:5]}")
    logged = sorted({r.get("cluster") for rows in records.values() for r in rows} - {CLUSTER, None})
    if logged:
        bad.append(f"records of clusters other than {CLUSTER!r} reached the stream: {logged[:5]}")
    if iso.get("error"):
        bad.append(f"the isolation checks failed to run: {iso['error']}")
    elif not iso.get("secret_tokens"):
        bad.append("the extraction replay could not run: no sampled output of 20+ varied tokens was logged")
    elif not iso.get("control_hits") or not iso.get("control_tokens_recovered"):
        bad.append(
            "the extraction replay's positive control failed (the owner's own probe found nothing), so the "
            "cross-tenant result proves nothing"
        )
    elif (
        iso.get("cross_tenant_hits")
        or iso.get("cross_tenant_reference_tokens")
        or iso.get("cross_tenant_tokens_recovered")
    ):
        bad.append(f"another tenant's output leaked through LLMA's past sessions: {iso}")
    return bad


# ---------------------------------------------------------------- analysis
def classify(attempts: list[Attempt], windows: list[Window], end: float) -> None:
    """Set each attempt's ``kind`` against the server's kill windows."""
    server = [(w.killed_at, w.back_at if w.back_at is not None else end) for w in windows if w.component == "server"]
    for a in attempts:
        if a.status == 200:
            a.kind = "answered"
            continue
        hit = next(((k, b) for k, b in server if a.start < b and a.end > k), None)
        a.kind = "failed" if hit is None else ("in_flight" if a.start < hit[0] else "down")


def check_records(run: dict) -> dict:
    """Accepted records lost, per ``benchmarks/faults.py``'s docstring, and what else the stream shows. Records the
    logger refused (``specops_stream_logger_dropped_total``: a build error, shedding) were never
    accepted: they are counted apart, as ``dropped``, and must be 0 too."""
    attempts: list[Attempt] = run["attempts"]
    by_rid = {a.rid: a for a in attempts}
    killed = {w.epoch: w for w in run["windows"] if w.component == "server"}
    dropped = {e: sum(got.get("dropped", {}).values()) for e, got in run.get("scrapes", {}).items()}
    out = {
        "lost": 0,
        "lost_detail": [],
        "unaccepted_at_kill": 0,
        "duplicates": 0,
        "unanswered_logged": 0,
        "checked": 0,
        "dropped": sum(dropped.values()),
    }
    for topic in TOPICS:
        rows = run["records"].get(topic, [])
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["rid"]] = counts.get(r["rid"], 0) + 1
        out["duplicates"] += sum(n - 1 for n in counts.values())
        out["unanswered_logged"] += sum(1 for rid in counts if rid in by_rid and by_rid[rid].status != 200)
        for epoch in range(run["final_epoch"] + 1):
            answered = [a for a in attempts if a.epoch == epoch and a.status == 200]
            out["checked"] += len(answered)
            missing = [a for a in answered if a.rid not in counts]
            refused = -(-dropped.get(epoch, 0) // len(TOPICS))  # a request's records are dropped together
            if epoch not in killed:  # stopped with SIGTERM: everything answered must be there
                lost = max(0, len(missing) - refused)
                why = f"{len(missing)} answered request(s) missing after the graceful stop, {refused} refused"
            else:
                present = [by_rid[rid] for rid in counts if rid in by_rid and by_rid[rid].epoch == epoch]
                latest_sent = max((a.start for a in present), default=float("-inf"))
                holes = [a for a in missing if a.end < latest_sent]
                accepted = (killed[epoch].published or {}).get(topic, 0)
                on_disk = sum(counts[a.rid] for a in present)
                lost = max(len(holes) - refused, accepted - on_disk, 0)
                out["unaccepted_at_kill"] += max(0, len(missing) - lost - refused)
                why = (
                    f"{len(holes)} hole(s) before a later record, {refused} refused; {accepted} accepted before "
                    f"the kill, {on_disk} in the stream"
                )
            if lost:
                out["lost_detail"].append(
                    {"topic": topic, "epoch": epoch, "lost": lost, "why": why, "missing": [a.rid for a in missing][:20]}
                )
            out["lost"] += lost
    return out


def check_versions(versions: list[dict]) -> dict:
    """Registered versions whose source_id or training window repeats an earlier version's."""
    seen_source, seen_window, dups = set(), set(), []
    for v in sorted(versions, key=lambda v: int(v["version"])):
        tags = v["tags"]
        source, window = tags.get("source_id"), tags.get("lineage_offsets")
        if (source and source in seen_source) or (window and window in seen_window):
            dups.append({"version": v["version"], "source_id": source, "lineage_offsets": window})
        seen_source.add(source)
        seen_window.add(window)
    promoted = [v for v in versions if v["tags"].get("gate_decision") == "promoted"]
    champion = next((v["version"] for v in versions if "champion" in v["aliases"]), None)
    return {
        "registered": len(versions),
        "duplicated": len(dups),
        "duplicates": dups,
        "promoted": len(promoted),
        "champion": champion,
    }


def check_outputs(attempts: list[Attempt], records: dict, model_dir: Path, args) -> dict:
    """Every answered request against target-only greedy decoding of its prompt in this process.

    *Identical*: the response text, and the token ids of its GenerationRecord when it was
    logged, equal the reference's. *Tie*: not identical, but every logged token is the
    target's greedy choice given the served prefix up to ``TIE_TOL`` (checked in float64): an
    exact float32 tie broken the other way by a batched verification, which
    ``serving/engine/batching.py`` documents. Anything else *diverged*."""
    from transformers import AutoModelForCausalLM

    from specops.core.models import load_model_dir
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams

    pair = load_model_dir(model_dir)
    engine, tok = SpecEngine(pair), pair.tokenizer
    params = SamplingParams(max_new_tokens=args.max_tokens)
    logged = {r["rid"]: r["output_ids"] for r in records.get("spec.generations", [])}
    target64 = None

    def worst_gap(prompt: list[int], out: list[int]) -> float:
        """Largest (max logit − logit of the served token) over the served positions, in float64."""
        nonlocal target64
        if target64 is None:
            target64 = AutoModelForCausalLM.from_pretrained(model_dir / "target", dtype=torch.float64).eval()
        with torch.no_grad():
            logits = target64(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]  # [len(out), vocab]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        return float((logits.max(dim=-1).values - chosen).max())

    answered = [a for a in attempts if a.status == 200]
    identical, ties, diverged = 0, [], []
    for a in tqdm(answered, desc="target-only references", unit="req"):
        prompt = make_prompt(args.seed, a.client, a.seq, args.vocab)
        ref = list(plain_generate(engine, prompt, params, method="target").token_ids)
        out = logged.get(a.rid)
        if a.text == tok.decode(ref, skip_special_tokens=True) and out in (None, ref):
            identical += 1
            continue
        row = {
            "rid": a.rid,
            "draft_version": a.draft_version,
            "text": a.text,
            "output_ids": out,
            "target_only": ref,
            "first_difference": next((i for i, (x, y) in enumerate(zip(out or [], ref)) if x != y), None),
        }
        if out is not None and a.text == tok.decode(out, skip_special_tokens=True):
            row["worst_gap"] = worst_gap(prompt, out)
            if row["worst_gap"] <= TIE_TOL:
                ties.append(row)
                continue
        diverged.append(row)
    return {
        "checked": len(answered),
        "identical": identical,
        "ties": len(ties),
        "diverged": len(diverged),
        "tokens_checked": sum(a.rid in logged for a in answered),
        "tie_detail": ties[:10],
        "diverged_detail": diverged[:10],
    }


def analyse(run: dict, model_dir: Path, args) -> dict:
    attempts: list[Attempt] = run["attempts"]
    iso = run.get("isolation", {})
    classify(attempts, run["windows"], run["load_s"])
    kinds = {k: sum(a.kind == k for a in attempts) for k in ("answered", "in_flight", "down", "failed")}
    records = check_records(run)
    versions = check_versions(run["versions"])
    outputs = check_outputs(attempts, run["records"], model_dir, args)
    windows = run["windows"]
    dropped = {}
    for got in run["scrapes"].values():  # per server incarnation, its last scrape
        for reason, n in got.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    by_comp = {}
    for c in COMPONENTS:
        ws = [w for w in windows if w.component == c]
        spans = [(w.killed_at, w.back_at if w.back_at is not None else run["load_s"]) for w in ws]
        over = [a for a in attempts if any(a.start < b and a.end > k for k, b in spans)]
        lengths = [b - k for k, b in spans]
        by_comp[c] = {
            "kills": len(ws),
            "window_s_median": statistics.median(lengths) if ws else None,
            "window_s_max": max(lengths, default=None),
            "requests_overlapping": len(over),
            "answered_overlapping": sum(a.status == 200 for a in over),
        }
    summary = {
        "requests": len(attempts),
        "answered": kinds["answered"],
        "failed_outside_kill_windows": kinds["failed"],
        "failed_in_flight_at_server_kill": kinds["in_flight"],
        "failed_sent_while_server_down": kinds["down"],
        "kills": {c: by_comp[c]["kills"] for c in COMPONENTS},
        "accepted_records_lost": records["lost"],
        "records_checked": records["checked"],
        "answered_unaccepted_at_kill": records["unaccepted_at_kill"],
        "duplicate_records": records["duplicates"],
        "records_of_unanswered_requests": records["unanswered_logged"],
        "logger_dropped": dropped,
        "logger_dropped_records": records["dropped"],
        "versions_registered": versions["registered"],
        "versions_duplicated": versions["duplicated"],
        "promotions": versions["promoted"],
        "draft_versions_served": sorted(
            {a.draft_version for a in attempts if a.status == 200},
            key=lambda v: (v != "base", int(v) if v.isdigit() else 0),
        ),
        "outputs_checked": outputs["checked"],
        "outputs_identical": outputs["identical"],
        "outputs_tie_flips": outputs["ties"],
        "outputs_diverged": outputs["diverged"],
        "output_tokens_checked": outputs["tokens_checked"],
        "server_exit_on_sigterm": run["server_rc"],
        "trainer_exit_on_sigint": run["trainer_rc"],
        "unknown_clusters_refused": f"{iso.get('bogus_clusters_refused')} / {iso.get('bogus_clusters_sent')}",
        "cross_tenant_session_hits": iso.get("cross_tenant_hits"),
        "cross_tenant_tokens_recovered": iso.get("cross_tenant_tokens_recovered"),
        "own_tenant_tokens_recovered": iso.get("control_tokens_recovered"),
    }
    violations = []
    if summary["failed_outside_kill_windows"]:
        violations.append(
            f"{summary['failed_outside_kill_windows']} request(s) failed outside the server's kill windows"
        )
    if summary["accepted_records_lost"]:
        violations.append(f"{summary['accepted_records_lost']} accepted record(s) lost: {records['lost_detail']}")
    if summary["logger_dropped_records"]:
        violations.append(
            f"the serving logger dropped {summary['logger_dropped_records']} record(s): {dropped} "
            "(the server log says why)"
        )
    if summary["versions_duplicated"]:
        violations.append(f"{summary['versions_duplicated']} duplicated version(s): {versions['duplicates']}")
    if summary["outputs_diverged"]:
        violations.append(
            f"{summary['outputs_diverged']} output(s) diverged from target-only: {outputs['diverged_detail'][:3]}"
        )
    if not summary["answered"]:
        violations.append("no request was answered")
    if run["server_rc"] != 0:
        violations.append(f"the server did not exit 0 on SIGTERM (exit {run['server_rc']})")
    violations += isolation_violations(iso, run["records"])
    summary["violations"] = violations
    summary["invariants_hold"] = not violations
    failures = [
        {
            "rid": a.rid,
            "kind": a.kind,
            "epoch": a.epoch,
            "start": round(a.start, 3),
            "end": round(a.end, 3),
            "status": a.status,
            "error": a.error,
        }
        for a in attempts
        if a.status != 200
    ]
    return {
        "summary": summary,
        "components": by_comp,
        "records": records,
        "versions": versions,
        "outputs": outputs,
        "isolation": iso,
        "failures": failures,
    }
