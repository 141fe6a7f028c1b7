"""``benchmarks/vllm_path.py``'s concurrency-1 design: balanced arm orders and the paired ratio."""

from collections import Counter

from benchmarks.vllm_path import ARMS, balanced_orders, paired_ratio


def test_every_arm_follows_every_other_equally_often():
    orders = balanced_orders(ARMS)
    assert all(sorted(o) == sorted(ARMS) for o in orders)
    follows = Counter((o[i], o[i + 1]) for o in orders for i in range(len(o) - 1))
    assert len(follows) == len(ARMS) * (len(ARMS) - 1)
    assert set(follows.values()) == {2}
    assert sum(o.index("llma") < o.index("auto") for o in orders) == len(orders) // 2


def _runs(latency: dict[str, list[float]]) -> dict[str, list[dict]]:
    return {
        a: [{"replies": [{"latency_s": x, "tokens": 10} for x in lat], "wall_s": sum(lat)}]
        for a, lat in latency.items()
    }


def test_paired_ratio_against_the_fastest_single_arm_with_an_interval():
    base = [1.0, 2.0, 1.5, 0.5, 3.0, 1.2, 0.8, 2.2]
    lat = {"target": [2 * x for x in base], "pld": [1.5 * x for x in base], "draft": [3 * x for x in base]}
    lat["llma"] = list(base)
    lat["auto"] = [x * 1.1 for x in base]  # 10 % slower on every case
    out = paired_ratio(_runs(lat), seed=0)
    assert out["best_single"] == "llma"
    assert abs(out["ratio"] - 1 / 1.1) < 1e-3
    lo, hi = out["ci95"]
    assert lo <= out["ratio"] <= hi and hi < 1.0  # every case slower: the interval excludes a tie
    assert out["auto_faster_cases"] == 0 and out["cases"] == len(base)
