"""Two trainer processes registering versions of one model at once, on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from specops.registry import RegistryConfig, RegistryStore

N = 8


def test_two_writers_lose_and_duplicate_nothing(pg_uri, tiny_models, tmp_path):
    artifacts = str(tmp_path / "artifacts")
    RegistryStore(RegistryConfig(uri=pg_uri, artifact_root=artifacts)).artifact(
        "draft"
    ).keys()  # tables, before the race
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.registry.proc_register",
                pg_uri,
                artifacts,
                "shared",
                str(N),
                writer,
                str(tiny_models / "draft"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for writer in ("a", "b")
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    claimed = [v for out, _ in outs for v in json.loads(out.strip().splitlines()[-1])]
    versions = RegistryStore(RegistryConfig(uri=pg_uri, artifact_root=artifacts)).artifact("draft").versions("shared")
    # every registration got its own version, and the registry holds exactly those: 1..2N, no gaps, no repeats
    assert sorted(map(int, claimed)) == list(range(1, 2 * N + 1))
    assert [v.version for v in versions] == [str(i) for i in range(1, 2 * N + 1)]
    sources = Counter(v.tags["source_id"] for v in versions)
    assert sources == Counter({f"{w}/{i}": 1 for w in "ab" for i in range(N)})
    assert len({v.run_id for v in versions}) == 2 * N
