"""The replica's Prometheus metrics, and how one served request counts in them.

:func:`count_request` counts a finished request: tokens, drafted and accepted per method (a
method's parts for ``auto``) and artifact version, and its method's own metrics
(:attr:`MethodSpec.count <specops.serving.proposers.catalogue.MethodSpec.count>`); the replica then
adds its mode's (:attr:`ModeSpec.count <specops.serving.modes.ModeSpec.count>`: retrieval, kNN-LM). Method labels are whatever the
catalogue holds when the request runs, so a method registered at run time is counted too.
The HTTP layer's own metrics live in ``specops.serving.http.gate`` (requests by endpoint and status) and
``specops.serving.http.latency`` (time to first token, inter-token latency, end to end). Throughput is a
rate of the counters (``rate(specops_generated_tokens_total[1m])``), not a gauge computed here.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from specops.core.clusters import cluster_label
from specops.core.errors import UnavailableError

GENERATED = Counter("specops_generated_tokens_total", "Tokens generated", ["cluster"])
PROMPT_TOKENS = Counter("specops_prompt_tokens_total", "Prompt tokens of served requests", ["cluster"])
DRAFTED = Counter("specops_drafted_tokens_total", "Draft tokens proposed", ["cluster", "method", "version"])
ACCEPTED = Counter("specops_accepted_tokens_total", "Draft tokens accepted", ["cluster", "method", "version"])
REJECTED_STEPS = Counter(
    "specops_rejected_steps_total",
    "Verification steps that rejected a drafted token (OSD's per-token alpha: accepted / (accepted + this))",
    ["cluster", "method", "version"],
)
ROUTED = Counter(
    "specops_routed_requests_total", "Requests per cluster and how the cluster was chosen", ["cluster", "source"]
)
CANCELLED = Counter("specops_requests_cancelled_total", "Requests ended early", ["reason"])
STEP_SECONDS = Counter(
    "specops_request_stage_seconds_total",
    "Seconds served requests spent proposing drafts and in target passes (waiting for a batch "
    "included); the rest of a request's time is Python per step, the tokenizer and HTTP",
    ["stage"],
)
READY = Gauge("specops_ready", "1 when the models are loaded and requests are served")
KNNLM_REQUESTS = Counter("specops_knnlm_requests_total", "kNN-LM requests", ["searcher", "mode"])
KNNLM_SEARCHES = Counter(
    "specops_knnlm_searches_total", "kNN-LM datastore searches (a batched verification is one)", ["searcher", "mode"]
)
KNNLM_TOKENS = Counter("specops_knnlm_tokens_total", "Tokens decoded by kNN-LM", ["searcher", "mode"])
LLMA_STEPS = Counter("specops_llma_steps_total", "LLMA proposer calls", ["cluster"])
LLMA_HITS = Counter(
    "specops_llma_hits_total", "LLMA proposer calls that copied, by the source of the best copy", ["cluster", "source"]
)
LLMA_REFERENCE_TOKENS = Counter(
    "specops_llma_reference_tokens_total",
    "Reference tokens LLMA requests sent (references and earlier chat turns)",
    ["cluster"],
)
SESSION_CACHE_TOKENS = Gauge(
    "specops_llma_session_cache_tokens",
    "Tokens of past outputs held per cluster (LLMA's cache-assisted source)",
    ["cluster"],
)
SESSION_CACHE_OUTPUTS = Gauge("specops_llma_session_cache_outputs", "Past outputs held per cluster", ["cluster"])
AUTO_STEPS = Counter(
    "specops_auto_steps_total",
    "Decoding steps of method 'auto' requests, by the method each step chose ('target': no draft)",
    ["cluster", "method"],
)
AUTO_ESTIMATE = Gauge(
    "specops_auto_estimate_tokens_per_second",
    "The auto policy's latest speed estimate of each option (its best k), per cluster",
    ["cluster", "method"],
)
AUTO_ACCEPTANCE = Gauge(
    "specops_auto_acceptance",
    "The auto policy's acceptance estimate (decayed, per drafted "
    "token) per cluster, method (llma@mN: copy at match length N+) and temperature bucket",
    ["cluster", "key", "temperature"],
)
AUTO_VERIFY_SECONDS = Gauge(
    "specops_auto_verify_seconds",
    "Measured target verify cost a + b*tokens in seconds, per requests-in-flight bucket",
    ["load", "coef"],
)
RALM_REQUESTS = Counter("specops_ralm_requests_total", "Retrieval-loop requests", ["retriever", "mode"])
RALM_KB_QUERIES = Counter("specops_ralm_kb_queries_total", "Queries sent to knowledge bases", ["retriever", "mode"])
RALM_KB_CALLS = Counter(
    "specops_ralm_kb_calls_total", "Knowledge-base searches (a batched verification is one)", ["retriever", "mode"]
)
RALM_SPECULATIONS = Counter(
    "specops_ralm_speculations_total", "Retrievals answered from a request's local cache", ["retriever", "mode"]
)
RALM_MISMATCHES = Counter(
    "specops_ralm_mismatches_total", "Verifications that found a wrong speculated passage", ["retriever", "mode"]
)
RALM_SECONDS = Counter(
    "specops_ralm_seconds_total",
    "Wall seconds of retrieval-loop requests by stage "
    "(retrieval waited for, generation, verification hidden by async overlap)",
    ["retriever", "mode", "stage"],
)


def count_request(plan, served, *, policy=None, sessions=None) -> None:
    """Count one served request (``plan``: its ``specops.serving.plan.DecodePlan``); its mode's own metrics
    are the mode's (``specops.serving.modes.ModeSpec.count``)."""
    st = served.result.stats
    label = cluster_label(plan.cluster)
    GENERATED.labels(label).inc(st.num_generated)
    for stage in ("propose", "verify"):
        STEP_SECONDS.labels(stage).inc(st.time_s.get(stage, 0.0))
    PROMPT_TOKENS.labels(label).inc(len(plan.prompt_ids))
    spec = plan.spec
    if spec.count is not None:
        spec.count(plan.cluster, st, policy)
    if sessions is not None:
        held = sessions.stats().get(plan.cluster)  # every tenant's together: no tenant label
        if held is not None:
            SESSION_CACHE_TOKENS.labels(label).set(held["tokens"])
            SESSION_CACHE_OUTPUTS.labels(label).set(held["outputs"])
    rejected = _rejected_steps(spec, st)
    for method, (drafted, accepted) in spec.split(st).items():
        if drafted:
            version = served.version_of(method) or "none"
            DRAFTED.labels(label, method, version).inc(drafted)
            ACCEPTED.labels(label, method, version).inc(accepted)
            REJECTED_STEPS.labels(label, method, version).inc(rejected.get(method, 0))


def _rejected_steps(spec, st) -> dict[str, int]:
    """Rejected verification steps per method used (``auto``'s parts report theirs in its policy block)."""
    if spec.parts is None:
        return {spec.name: st.num_rejected_steps}
    return {m: n.get("rejected_steps", 0) for m, n in (st.policy or {}).get("methods", {}).items()}


def count_llma(cluster: str, stats) -> None:
    """LLMA's copy counters of one request (its proposer's counters: ``hits_<source>`` for each of
    ``specops.serving.proposers.llma.SOURCES``, so this floor needs no proposer's names)."""
    label = cluster_label(cluster)
    counters = stats.proposer
    if not counters:
        return
    LLMA_STEPS.labels(label).inc(counters["steps"])
    LLMA_REFERENCE_TOKENS.labels(label).inc(counters["reference_tokens"])
    for key, hits in counters.items():
        if key.startswith("hits_"):
            LLMA_HITS.labels(label, key.removeprefix("hits_")).inc(hits)


def count_auto(cluster: str, stats, policy) -> None:
    """An ``auto`` request's steps per chosen method, and the policy's gauges."""
    label = cluster_label(cluster)
    for method, n in (stats.policy or {}).get("methods", {}).items():
        AUTO_STEPS.labels(label, method).inc(n["steps"])
    try:  # the gauges wait briefly for the policy's lock, the response does not wait on them
        snap = policy.snapshot(cluster, timeout_s=1.0) if policy is not None else {}
    except UnavailableError:
        snap = {}
    state = snap.get("clusters", {}).get(cluster, {})
    for method, speed in ((state.get("last") or {}).get("estimates") or {}).items():
        AUTO_ESTIMATE.labels(label, method).set(speed)
    for name, est in state.get("acceptance", {}).items():
        key, temp = name.rsplit("/", 1)
        AUTO_ACCEPTANCE.labels(label, key, temp).set(est["mean"])
    for load, fit in snap.get("verify_ms", {}).items():
        AUTO_VERIFY_SECONDS.labels(load, "a").set(fit["a_ms"] / 1000.0)
        AUTO_VERIFY_SECONDS.labels(load, "b").set(fit["b_ms"] / 1000.0)


def count_retrieval(block: dict | None) -> None:
    """Per-retriever metrics of one retrieval-loop request (RaLMSeq, RaLMSpec, one-shot)."""
    if not block:
        return
    labels = (block["retriever"], block["mode"])
    RALM_REQUESTS.labels(*labels).inc()
    RALM_KB_QUERIES.labels(*labels).inc(block["kb_queries"])
    RALM_KB_CALLS.labels(*labels).inc(block["kb_calls"])
    RALM_SPECULATIONS.labels(*labels).inc(block["speculations"])
    RALM_MISMATCHES.labels(*labels).inc(block["mismatches"])
    t = block["time_s"]
    RALM_SECONDS.labels(*labels, "retrieval").inc(t["embed"] + t["cache"] + t["kb_wait"])
    RALM_SECONDS.labels(*labels, "generate").inc(t["generate"])
    RALM_SECONDS.labels(*labels, "async_overlap").inc(t["async_overlap"])


def count_knnlm(block: dict | None) -> None:
    """Searcher metrics of one kNN-LM request."""
    if not block:
        return
    KNNLM_REQUESTS.labels(block["searcher"], block["mode"]).inc()
    KNNLM_SEARCHES.labels(block["searcher"], block["mode"]).inc(block["kb_searches"])
    KNNLM_TOKENS.labels(block["searcher"], block["mode"]).inc(block["tokens"])
