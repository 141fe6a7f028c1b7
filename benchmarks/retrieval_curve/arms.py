"""The retrieval curve's drafters (``benchmarks/dresd_curve.py`` is the benchmark, run by
``benchmarks/dresd.py --curve``): DReSD, REST, REST's rule and the hybrid replayed greedily on the
target's outputs, decoded live with ``SpecEngine``, their search latency, and the fitted lines."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.rest_baseline import RestIndex, RestProposer
from specops.core.datastore import Datastore
from specops.core.suffix import MAX_N
from specops.serving.engine.types import DecodeState, SamplingParams, Verdict
from specops.serving.plan import plain_generate
from specops.serving.proposers.retrieval import RetrievalProposer

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


def replay(cases: list[Replay], propose, *, key: str = "final", cost: tuple[float, float] | None = None) -> dict:
    """``propose(context, hidden_or_None) -> rows`` over every case; the paper's MAR and the rest.
    With ``cost`` = (a, b) seconds (a target pass over t tokens costs a + b * t), also
    ``priced_speedup``: target-only's seconds per token over the drafter's, each step a pass over
    its tree's nodes plus the target's own token, plus the drafter's own measured time."""
    per_case, steps, accepted_total, drafted_steps, nodes, spent = [], 0, 0, 0, 0, 0.0
    for case in cases:
        if hasattr(propose, "start"):  # a per-request drafter (REST's library: a fresh reader)
            propose.start()
        seq, c = case.seq, len(case.prompt)
        drafted = accepted = 0
        first = True
        while c < len(seq):
            hidden = None if first else key_states_row(case.states, key, c - 2)
            t0 = time.perf_counter()
            rows = [r for r in propose(seq[:c], hidden) if r]
            spent += time.perf_counter() - t0
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
    out = {
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
        "propose_ms": round(1000 * spent / steps, 3) if steps else 0.0,
    }
    if cost is not None and steps:
        a, b = cost
        step_s = a + b * (1 + nodes / steps) + spent / steps
        out["priced_speedup"] = round((accepted_total / steps + 1) * (a + b) / step_s, 3)
    return out


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
        return ProposerRows(
            lambda: RetrievalProposer(store, n_drafts=n, dense_below=below, exact_nodes=REST_CHOICES), k
        )

    return {
        "rest": RestRows(),
        "rest_rule": rest_rule,
        "dresd": dense_rows,
        "hybrid": hybrid(dense_below),
        "_hybrid": hybrid,
    }


_GREEDY = SamplingParams(max_new_tokens=1)


class ProposerRows:
    """A serving proposer driven by the replay: a fresh one per case (``start``), each step the
    committed tokens as its state and the key state before them as the verifier's hidden state."""

    def __init__(self, make, k: int) -> None:
        self.make, self.k, self.proposer = make, k, None

    def start(self) -> None:
        self.proposer = self.make()
        self.proposer.start(DecodeState(token_ids=[], num_prompt_tokens=0, params=_GREEDY))

    def __call__(self, ctx, hidden):
        if self.proposer is None:
            self.start()
        state = DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=_GREEDY)
        h = None if hidden is None else torch.from_numpy(np.ascontiguousarray(hidden))
        self.proposer.observe(state, Verdict(accepted=[], bonus=int(ctx[-1]), num_drafted=0, target_hidden=h))
        return self.proposer.propose(state, self.k).rows()


def serving_hybrid(store: Datastore, *, dense_below: int, exact_nodes: int, k: int = 10) -> ProposerRows:
    """The live arm's hybrid (one dense row, ``exact_nodes`` trie nodes) for the replay."""
    return ProposerRows(
        lambda: RetrievalProposer(store, n_drafts=1, dense_below=dense_below, exact_nodes=exact_nodes), k
    )


# ---------------------------------------------------------------- live
def live_arms(store: Datastore, rest: RestIndex, dense_below: int, exact_nodes: int) -> dict:
    """name -> (factory of a fresh proposer, k); None: target-only. REST at its native 64 nodes (the
    fastest REST arm on this hardware), DReSD at the 1 x 4 shape its rebuild replay picks on 2 CPU
    cores, the hybrid with one dense row and the ``dense_below`` and ``exact_nodes`` the dev split
    chose (serving's defaults once committed)."""
    from specops.serving.proposers.dresd import DReSDProposer

    return {
        "target": None,
        "rest": (lambda: RestProposer(rest, choices=REST_CHOICES), 10),
        "dresd": (lambda: DReSDProposer(store, n_drafts=1), 4),
        "hybrid": (
            lambda: RetrievalProposer(store, n_drafts=1, dense_below=dense_below, exact_nodes=exact_nodes),
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


TUNE_DENSE_BELOW = (0, 2, 4, 6, 8, MAX_N + 1)
TUNE_EXACT_NODES = (4, 8, 16, 24)


def tune_hybrid(
    store: Datastore, dev: dict[str, list[Replay]], cost: tuple[float, float], dense_below=None, exact_nodes=None
) -> dict:
    """The live hybrid's ``dense_below`` and ``exact_nodes`` that maximise the priced speed-up
    (geometric mean over the dev sets) of a replay of the dev split: the grid
    :data:`TUNE_DENSE_BELOW` x :data:`TUNE_EXACT_NODES` (or the one value given for either)."""
    belows = TUNE_DENSE_BELOW if dense_below is None else (dense_below,)
    nodes = TUNE_EXACT_NODES if exact_nodes is None else (exact_nodes,)
    grid = []
    for b in belows:
        for e in nodes:
            per_set = {
                name: replay(cs, serving_hybrid(store, dense_below=b, exact_nodes=e), cost=cost)
                for name, cs in dev.items()
            }
            speed = float(np.exp(np.mean([np.log(max(r["priced_speedup"], 1e-6)) for r in per_set.values()])))
            grid.append(
                {
                    "dense_below": b,
                    "exact_nodes": e,
                    "priced_speedup": round(speed, 4),
                    "al": {n: r["al"] for n, r in per_set.items()},
                    "nodes_per_step": {n: r["nodes_per_step"] for n, r in per_set.items()},
                }
            )
    best = max(grid, key=lambda g: g["priced_speedup"])
    return {
        "grid": grid,
        "chosen": {"dense_below": best["dense_below"], "exact_nodes": best["exact_nodes"]},
        "objective": "geometric mean over the dev sets of the priced speed-up (replay, measured verify cost)",
    }
