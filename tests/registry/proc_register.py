"""A process that registers N versions of one draft (the concurrent-writers test runs two)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specops.registry import RegistryConfig, RegistryStore


def main() -> None:
    uri, artifacts, cluster, n, writer, model_dir = sys.argv[1:7]
    reg = RegistryStore(RegistryConfig(uri=uri, artifact_root=artifacts))
    out = []
    for i in range(int(n)):
        dv = reg.artifact("draft").register(
            cluster,
            Path(model_dir),
            tokenizer_sha256="t",
            source_id=f"{writer}/{i}",
            metrics={"offline_acceptance_sampling": i / 100},
        )
        out.append(dv.version)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
