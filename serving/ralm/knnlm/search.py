"""Nearest-neighbour search for the kNN-LM datastore: squared L2, batch-invariant.

A query's neighbours must not depend on the batch it was searched in: RaLMSpec verifies ``s``
speculated positions with one batched search, and the output is the one-query baseline's
only if every row of that batch is exactly what the query alone would get.

- ``exact`` (:class:`ExactSearcher`): distances ``|q|² - 2 q·k + |k|²`` from one GEMM per
  block of ``QUERY_BLOCK`` queries (padded with zeros) and ``KEY_BLOCK`` keys (padded, at
  infinite distance), so every distance comes from a product of one shape; then the ``k``
  smallest, ties to the lower entry id (:func:`select_nearest`: a unique answer, whichever
  way the candidates were split). A request's cache searches its keys with the same code.
- ``ivfpq`` (:class:`IvfpqSearcher`): FAISS ``IndexIVFPQ`` (L2), queried in chunks of at
  most ``QUERY_BLOCK`` queries; FAISS scans each query of a chunk on its own (tested). Its
  cache rows are FAISS's reconstructions (centroid + decoded residual: the points its
  distances approximate), offered to a query only when they lie in one of the ``nprobe``
  lists the index would scan for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUERY_BLOCK = 16
"""Queries per search block: a verification batch (OS³'s largest stride) fits in one."""
KEY_BLOCK = 4096
"""Keys per distance block of the exact searcher (and of the request's cache)."""


@dataclass
class Neighbours:
    """Nearest entries of a batch of queries, nearest first: ``ids`` [n, k] int64 (-1: none)
    and squared L2 ``dists`` [n, k] float32 (inf where ids is -1)."""

    ids: torch.Tensor
    dists: torch.Tensor

    def row(self, i: int) -> Neighbours:
        return Neighbours(self.ids[i : i + 1], self.dists[i : i + 1])


def select_nearest(d: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` smallest of ``d`` [n, m] per row, ordered by (distance, id); ``ids`` [m] or
    [n, m] (distinct per row, any order). A tie at the k-th distance keeps the lowest ids, so
    the answer is unique and the same whichever way the candidates were split or ordered.
    Returns (dists, ids) [n, k].

    ``topk`` first; only a row whose k-th distance is tied with entries ``topk`` left out
    (duplicate keys, or fewer finite distances than ``k``) takes the exact tie-break."""
    n, m = d.shape
    ids = ids.expand(n, m) if ids.dim() == 1 else ids
    k = min(k, m)
    dd, pos = d.topk(k, dim=1, largest=False)  # [n, k], ties in no promised order
    ii = ids.gather(1, pos)
    kth = dd[:, -1:]
    cut = (d == kth).sum(1) != (dd == kth).sum(1)  # [n] a tie straddles the k-th place
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]
        dd, ii = dd.clone(), ii.clone()
        dd[rows], ii[rows] = _select_tied(d[rows], ids[rows], k)
    by_id = ii.sort(dim=1, stable=True).indices
    dd, ii = dd.gather(1, by_id), ii.gather(1, by_id)
    by_dist = dd.sort(dim=1, stable=True).indices
    return dd.gather(1, by_dist), ii.gather(1, by_dist)


def _select_tied(d: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_nearest`'s exact path: everything below the k-th distance, then the lowest
    ids among those at it (unordered; the caller orders them)."""
    n, m = d.shape
    kth = d.kthvalue(k, dim=1, keepdim=True).values  # [n, 1]
    below, tied = d < kth, d == kth
    need = k - below.sum(1, keepdim=True)  # [n, 1] tied entries still to take, lowest ids first
    tied_ids = torch.where(tied, ids, torch.full_like(ids, torch.iinfo(torch.int64).max))
    lowest = tied_ids.topk(max(1, int(need.max())), dim=1, largest=False).values  # [n, *] ascending
    cutoff = lowest.gather(1, (need - 1).clamp(min=0))  # the largest tied id taken
    take = below | (tied & (ids <= cutoff) & (need > 0))
    assert bool((take.sum(1) == k).all()), "select_nearest: ids must be distinct per row"
    pos = take.nonzero()[:, 1].view(n, k)
    return d.gather(1, pos), ids.gather(1, pos)


def padded_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` [m, d] float32 padded with zero rows to a multiple of KEY_BLOCK, and their
    squared norms (+inf on the padding, so a padded row is never near)."""
    m, dim = keys.shape
    rows = max(KEY_BLOCK, -(-m // KEY_BLOCK) * KEY_BLOCK)
    out = torch.zeros((rows, dim), dtype=torch.float32, device=keys.device)
    out[:m] = keys
    norms = torch.full((rows,), float("inf"), dtype=torch.float32, device=keys.device)
    norms[:m] = (out[:m] * out[:m]).sum(1)
    return out, norms


def blocked_l2(queries: torch.Tensor, keys: torch.Tensor, norms: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Squared L2 distances [QUERY_BLOCK, num_rows] of one padded query block [QUERY_BLOCK, d]
    to the first ``num_rows`` (a multiple of KEY_BLOCK) of ``keys``: one GEMM of the same shape
    per key block, so a distance never depends on the other queries or keys."""
    assert queries.shape[0] == QUERY_BLOCK and num_rows % KEY_BLOCK == 0, (queries.shape, num_rows)
    qn = (queries * queries).sum(1, keepdim=True)  # [Q, 1]
    out = [
        torch.addmm(norms[b : b + KEY_BLOCK][None], queries, keys[b : b + KEY_BLOCK].T, alpha=-2.0)
        for b in range(0, num_rows, KEY_BLOCK)
    ]
    return (torch.cat(out, dim=1) + qn).clamp_(min=0.0)  # [Q, num_rows]


def search_keys(
    queries: torch.Tensor,
    keys: torch.Tensor,
    norms: torch.Tensor,
    ids: torch.Tensor,
    k: int,
    mask: torch.Tensor | None = None,
) -> Neighbours:
    """The ``k`` nearest of padded ``keys`` (entry ``ids`` [rows], -1 on padding) to ``queries``
    [n, d], in query blocks; ``mask`` [n, rows] bool (optional) hides a key from a query."""
    n, rows = queries.shape[0], keys.shape[0]
    out_d, out_i = [], []
    for q0 in range(0, n, QUERY_BLOCK):
        qb = torch.zeros((QUERY_BLOCK, keys.shape[1]), dtype=torch.float32, device=keys.device)
        nq = min(QUERY_BLOCK, n - q0)
        qb[:nq] = queries[q0 : q0 + nq].to(keys.device, torch.float32)
        d = blocked_l2(qb, keys, norms, rows)[:nq]
        if mask is not None:
            d = d.masked_fill(~mask[q0 : q0 + nq].to(d.device), float("inf"))
        dd, ii = select_nearest(d, ids.to(d.device), k)
        out_d.append(dd.cpu())
        out_i.append(ii.cpu())
    dists, idx = torch.cat(out_d), torch.cat(out_i)
    gone = ~torch.isfinite(dists) | (idx < 0)
    return Neighbours(idx.masked_fill(gone, -1), dists.masked_fill(gone, float("inf")))


@dataclass
class CacheRows:
    """Keys of some entries, as a request's cache holds them: ``keys`` [m, d] float32 (exact:
    the stored keys; ivfpq: FAISS's reconstructions, the points its distances approximate),
    their squared ``norms`` [m] (exact: the datastore's own, bit for bit) and ``lists`` [m]
    int64 (ivfpq: the inverted list of each entry; else None)."""

    keys: torch.Tensor
    norms: torch.Tensor
    lists: torch.Tensor | None = None


class ExactSearcher:
    """Every key, searched with :func:`search_keys` (keys float32 in memory, padded)."""

    kind = "exact"

    def __init__(self, keys: torch.Tensor, device: str | torch.device = "cpu") -> None:
        self.num_entries = int(keys.shape[0])
        self.keys, self.norms = padded_keys(keys.to(device, torch.float32))
        self.ids = torch.arange(self.keys.shape[0], device=device)  # padding rows: distinct ids, infinite distance

    def search(self, queries: torch.Tensor, k: int) -> Neighbours:
        return search_keys(queries, self.keys, self.norms, self.ids, k)

    def rows(self, ids: torch.Tensor) -> CacheRows:
        ids = ids.to(self.keys.device)
        return CacheRows(self.keys[ids], self.norms[ids])

    def probe_mask(self, queries: torch.Tensor, lists: torch.Tensor | None) -> torch.Tensor | None:
        return None


class IvfpqSearcher:
    """FAISS IndexIVFPQ over the keys (L2), ``nprobe`` lists per query."""

    kind = "ivfpq"

    def __init__(self, index, nprobe: int) -> None:
        import faiss

        self.index = index
        self.index.nprobe = int(nprobe)
        self.num_entries = int(index.ntotal)
        if index.direct_map.type == faiss.DirectMap.NoMap:
            index.make_direct_map()  # for reconstruct(): the cache's keys
        # Each entry's inverted list (read off the lists: exactly where FAISS put it).
        self.entry_list = np.empty(self.num_entries, dtype=np.int64)
        invlists = index.invlists
        for lst in range(index.nlist):
            size = invlists.list_size(lst)
            if size:
                self.entry_list[faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy()] = lst

    @property
    def nprobe(self) -> int:
        return int(self.index.nprobe)

    def search(self, queries: torch.Tensor, k: int) -> Neighbours:
        q = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        ds, ii = [], []
        for q0 in range(0, len(q), QUERY_BLOCK):  # small chunks: each query scanned on its own
            d, i = self.index.search(q[q0 : q0 + QUERY_BLOCK], min(k, self.num_entries))
            ds.append(d)
            ii.append(i)
        dists, idx = torch.from_numpy(np.concatenate(ds)).float(), torch.from_numpy(np.concatenate(ii)).long()
        gone = idx < 0
        return Neighbours(idx.masked_fill(gone, -1), dists.masked_fill(gone, float("inf")))

    def rows(self, ids: torch.Tensor) -> CacheRows:
        ids_np = ids.cpu().numpy().astype(np.int64)
        keys = torch.from_numpy(self.index.reconstruct_batch(ids_np)).float()
        return CacheRows(keys, (keys * keys).sum(1), torch.from_numpy(self.entry_list[ids_np]))

    def probe_mask(self, queries: torch.Tensor, lists: torch.Tensor | None) -> torch.Tensor | None:
        """[n, m] True where a cached entry lies in one of the ``nprobe`` lists the index would
        scan for the query: the cache then only offers entries the index could have returned."""
        q = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        _, probed = self.index.quantizer.search(q, self.nprobe)  # [n, nprobe]
        probed = torch.from_numpy(probed)
        return (lists[None, :, None] == probed[:, None, :]).any(-1)


def _pq_m(hidden: int) -> int:
    target = max(1, hidden // 8)
    return max(m for m in range(1, target + 1) if hidden % m == 0)


def build_ivfpq(
    keys: np.ndarray,
    *,
    nlist: int = 0,
    pq_m: int = 0,
    pq_bits: int = 8,
    nprobe: int = 16,
    train_sample: int = 65_536,
    seed: int = 0,
):
    """A trained, filled IndexIVFPQ over ``keys`` [n, d] float32: ``nlist`` lists (0: about
    sqrt(n)), ``pq_m`` sub-quantizers of ``pq_bits`` bits (0: d/8, a divisor of d), trained on
    at most ``train_sample`` keys (seeded). Lists and codebooks shrink to what the keys can
    train (FAISS asks for 39 points per centroid)."""
    import faiss

    n, d = keys.shape
    nlist = max(1, min(nlist or int(round(np.sqrt(n))), n // 39))
    m = pq_m or _pq_m(d)
    if d % m:
        raise ValueError(f"pq_m={m} does not divide the hidden size {d}")
    bits = max(1, min(pq_bits, int(np.log2(max(2, n // 39)))))
    index = faiss.IndexIVFPQ(faiss.IndexFlatL2(d), d, nlist, m, bits)
    rng = np.random.default_rng(seed)
    sample = keys if n <= train_sample else keys[np.sort(rng.choice(n, train_sample, replace=False))]
    index.cp.seed = index.pq.cp.seed = seed
    index.train(np.ascontiguousarray(sample))
    index.add(np.ascontiguousarray(keys))
    index.nprobe = nprobe
    return index
