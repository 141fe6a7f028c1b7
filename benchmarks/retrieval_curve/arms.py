"""The retrieval curve's drafters (``benchmarks/dresd_curve.py`` is the benchmark, run by
``benchmarks/dresd.py --curve``): DReSD, REST, REST's rule and the hybrid replayed greedily on the
target's outputs, decoded live with ``SpecEngine``, their search latency, and the fitted lines."""

from __future__ import annotations

import statistics
import time

import numpy as np
from tqdm import tqdm

from benchmarks.rest_baseline import RestIndex, RestProposer
from specops.core.datastore import Datastore
from specops.core.suffix import MAX_N
from specops.serving.engine.types import DecodeState, SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.retrieval import RetrievalProposer, merge_rows

SHAPE = (10, 10)
"""DReSD's rows x tokens (the paper's 10 x 10) for every dense arm."""
REST_CHOICES = 64
NODE_COST, STEP_OVERHEAD = 0.15, 0.04
"""The rebuild job's cost model (``specops.trainer.datastores``): a verified tree node costs 0.15 of a
one-token target pass on 2 CPU cores, a step 4 % more than the pass."""
ARMS = ("dresd", "rest", "rest_rule", "hybrid")
"""Replayed drafters: DReSD, REST through its library, REST's rule in our code, the hybrid."""


# ---------------------------------------------------------------- replay
class Replay:
    """One prompt's greedy replay: its full sequence (prompt + the target's output) and key states."""

    def __init__(self, prompt: list[int], output: list[int], states: dict[str, np.ndarray]):
        self.prompt, self.seq, self.states = prompt, prompt + output, states


def replay(cases: list[Replay], propose, *, key: str = "final") -> dict:
    """``propose(context, hidden_or_None) -> rows`` over every case; the paper's MAR and the rest."""
    per_case, steps, accepted_total, drafted_steps, nodes = [], 0, 0, 0, 0
    for case in cases:
        if hasattr(propose, "start"):  # a per-request drafter (REST's library: a fresh reader)
            propose.start()
        seq, c = case.seq, len(case.prompt)
        drafted = accepted = 0
        first = True
        while c < len(seq):
            hidden = None if first else key_states_row(case.states, key, c - 2)
            rows = [r for r in propose(seq[:c], hidden) if r]
            best = 0
            for row in rows:
                n = 0
                while n < len(row) and c + n < len(seq) and row[n] == seq[c + n]:
                    n += 1
                best = max(best, n)
            if rows:
                drafted_steps += 1
                drafted += max(len(r) for r in rows)
                nodes += len({tuple(r[: j + 1]) for r in rows for j in range(len(r))})
            accepted += best
            steps += 1
            c += best + 1
            first = False
        accepted_total += accepted
        per_case.append(accepted / drafted if drafted else 0.0)
    return {
        "mar": round(float(np.mean(per_case)), 4) if per_case else 0.0,
        "al": round(accepted_total / steps, 4) if steps else 0.0,
        "drafted_fraction": round(drafted_steps / steps, 4) if steps else 0.0,
        "nodes_per_step": round(nodes / steps, 2) if steps else 0.0,
        "steps": steps,
        # tokens per unit of step time against target-only's 1, with a verified node costing
        # NODE_COST of a one-token pass (2 CPU cores, SmolLM2-135M; specops.trainer.datastores.choose_shape)
        "speed_model": round((accepted_total / steps + 1) / (1 + STEP_OVERHEAD + NODE_COST * nodes / steps), 3)
        if steps
        else 0.0,
    }


def key_states_row(states: dict, key: str, pos: int) -> np.ndarray:
    if key == "concat":
        return np.concatenate([states["middle"][pos], states["final"][pos]])
    return states[key][pos]


def proposers(store: Datastore, rest: RestIndex, *, dense_below: int, k: int = 10) -> dict:
    """name -> propose(context, hidden) for the replay."""
    n, length = SHAPE
    rest_p = RestProposer(rest, choices=REST_CHOICES)
    suffix = store.suffix_index()

    class RestRows:  # REST's library, a fresh reader per request (``rest_baseline``)
        def start(self):
            rest_p.start()

        def __call__(self, ctx, hidden):
            state = DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=_GREEDY)
            return rest_p.propose(state, k).rows()

    def rest_rule(ctx, hidden):  # REST's rule (16 down to 2 tokens) over the datastore's tokens, ours
        return suffix.lookup(ctx[-MAX_N:], k, max_nodes=REST_CHOICES).rows

    def dense_rows(ctx, hidden):
        return [] if hidden is None else store.drafts(hidden, int(ctx[-1]), n_drafts=n, length=length)

    def hybrid(below):
        def rows(ctx, hidden):
            exact = suffix.lookup(ctx[-MAX_N:], k, max_nodes=REST_CHOICES)
            dense = dense_rows(ctx, hidden) if exact.length < below else []
            return merge_rows(exact.rows, dense)

        return rows

    return {
        "rest": RestRows(),
        "rest_rule": rest_rule,
        "dresd": dense_rows,
        "hybrid": hybrid(dense_below),
        "_hybrid": hybrid,
    }


_GREEDY = SamplingParams(max_new_tokens=1)


# ---------------------------------------------------------------- live
def live_arms(store: Datastore, rest: RestIndex, dense_below: int) -> dict:
    """name -> (factory of a fresh proposer, k); None: target-only. REST at its native 64 nodes (the
    fastest REST arm on this hardware), DReSD at the 1 x 4 shape its rebuild replay picks on 2 CPU
    cores, the hybrid at serving's defaults with one dense row (the same CPU budget)."""
    from specops.serving.proposers.dresd import DReSDProposer
    from specops.serving.proposers.retrieval import EXACT_NODES

    return {
        "target": None,
        "rest": (lambda: RestProposer(rest, choices=REST_CHOICES), 10),
        "dresd": (lambda: DReSDProposer(store, n_drafts=1), 4),
        "hybrid": (
            lambda: RetrievalProposer(store, n_drafts=1, dense_below=dense_below, exact_nodes=EXACT_NODES),
            10,
        ),
    }


def run_live(engine, arms: dict, prompts: list[list[int]], new_tokens: int, desc: str) -> dict:
    """Median tokens/s per arm over ``prompts`` (arms rotated per prompt) and greedy equality."""
    tps = {a: [] for a in arms}
    identical = True
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        order = list(arms)
        order = order[i % len(order) :] + order[: i % len(order)]
        outs = {}
        for a in order:
            params = SamplingParams(max_new_tokens=new_tokens)
            if arms[a] is None:
                r = plain_generate(engine, prompt, params, method="target")
            else:
                make, k = arms[a]
                r = plain_generate(engine, prompt, params, proposer=make(), k=k)
            outs[a] = r.token_ids
            tps[a].append(r.stats.tokens_per_s)
        identical &= all(o == outs["target"] for o in outs.values())
    med = {a: round(statistics.median(v), 2) for a, v in tps.items()}
    return {
        "tokens_per_s": med,
        "vs_target": {a: round(v / med["target"], 3) for a, v in med.items()},
        "identical": identical,
    }


def search_p50_ms(store: Datastore, rest: RestIndex, queries: list[tuple[list[int], np.ndarray]]) -> dict:
    """Single-query search latency: DReSD's index, REST's suffix array, the hybrid's exact lookup."""
    rest_p = RestProposer(rest, choices=REST_CHOICES)
    suffix = store.suffix_index()
    out = {"dresd": [], "rest": [], "hybrid_exact": []}
    for ctx, hidden in queries:
        t = time.perf_counter()
        store.search(hidden.reshape(1, -1), 80)
        out["dresd"].append(time.perf_counter() - t)
        t = time.perf_counter()
        rest_p.propose(DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=_GREEDY), 10)
        out["rest"].append(time.perf_counter() - t)
        t = time.perf_counter()
        suffix.lookup(ctx[-MAX_N:], 10, max_nodes=REST_CHOICES)
        out["hybrid_exact"].append(time.perf_counter() - t)
    return {a: round(1000 * statistics.median(v), 3) for a, v in out.items()}


def extrapolate(curve: list[dict], set_name: str) -> dict:
    """A straight line of accepted tokens per step against log10(entries) per drafter, and where
    DReSD's would meet REST's (an extrapolation past the measured sizes, said as one)."""
    curve = [p for p in curve if set_name in p["sets"]]
    x = np.log10([p["entries"] for p in curve])
    if len(x) < 2:
        return {}
    fit = {}
    for arm in ("dresd", "rest"):
        y = np.array([p["sets"][set_name][arm]["al"] for p in curve])
        slope, icpt = np.polyfit(x, y, 1)
        fit[arm] = {"slope_per_decade": round(float(slope), 4), "intercept": round(float(icpt), 4)}
    ds, rs = fit["dresd"]["slope_per_decade"], fit["rest"]["slope_per_decade"]
    gap = fit["rest"]["intercept"] - fit["dresd"]["intercept"]
    cross, above = None, bool(gap < 0)  # above: DReSD's line is over REST's at 1 entry already
    if abs(ds - rs) > 1e-6:
        cross_log = gap / (ds - rs)
        if x.min() < cross_log < 15:  # past the smallest measured size, within reason
            cross = float(10**cross_log)
    if cross is None:
        above = bool(
            np.polyval([ds, fit["dresd"]["intercept"]], x.max()) > np.polyval([rs, fit["rest"]["intercept"]], x.max())
        )
    return {**fit, "crossing_entries": cross, "dresd_above_at_largest": above, "extrapolated": True}
