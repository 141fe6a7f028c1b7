"""What ``/v1/policy`` and the metrics read of an :class:`~specops.core.auto_policy.AutoPolicy`:
its acceptance estimates, decisions and latest choice per cluster, and the replica's costs."""

from __future__ import annotations

from specops.core.auto_fits import LOAD_BUCKETS
from specops.core.errors import UnavailableError


def snapshot(policy, cluster: str | None = None, *, timeout_s: float = -1) -> dict:
    """The policy's state, per cluster (only ``cluster``'s when given): acceptance estimates,
    decisions, the latest choice; and the replica's costs. With ``timeout_s`` >= 0, waits at
    most that long for the lock, then raises ``UnavailableError`` (503)."""
    if not policy.lock.acquire(timeout=timeout_s):
        raise UnavailableError(f"the auto policy is busy (its lock was held for over {timeout_s:g}s); retry")
    try:
        clusters: dict[str, dict] = {}

        def of(c: str) -> dict | None:
            return clusters.setdefault(c, {"acceptance": {}, "decisions": {}}) if cluster in (None, c) else None

        for (c, key, t), v in policy.counts.items():
            if entry := of(c):
                entry["acceptance"][f"{key}/{t}"] = {"mean": round(v.mean, 4), "trials": round(v.trials, 1)}
        for (c, m), n in policy.decisions.items():
            if entry := of(c):
                entry["decisions"][m] = n
        for c, ch in policy.last.items():
            if entry := of(c):
                last = {"method": ch.method, "k": ch.k, "tokens_per_s": round(ch.speed, 2)}
                entry["last"] = {**last, "estimates": ch.alternatives}
        return {
            "in_flight": policy.in_flight,
            "load": policy.load(),
            "emitted_per_step": round(policy.emitted_per_step, 3),
            "verify_ms": {str(LOAD_BUCKETS[b]): f.to_dict() for b, f in sorted(policy.verify.items())},
            "catchup_ms": {m: f.to_dict() for m, f in policy.catchup.items()},
            "realized": {f"{m}@{LOAD_BUCKETS[b]}": c.to_dict() for (m, b), c in sorted(policy.realized.items())},
            "co_running": policy.corun.to_dict(),
            "propose_ms": {
                **{m: f.to_dict() for m, f in policy.propose.items()},
                **{f"{m}@{LOAD_BUCKETS[b]}": f.to_dict() for (m, b), f in sorted(policy.propose_loaded.items())},
            },
            "clusters": clusters,
        }
    finally:
        policy.lock.release()
