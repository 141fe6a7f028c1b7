"""The auto policy's decisions go to the stream with every generation; ``specops policy fit``
sums them into priors and a report, registers them as the ``policy`` kind, and a new policy
starts from them."""

from __future__ import annotations

import json

from specops.cli.main import main
from specops.cli.policy import read_generations
from specops.core.auto_policy import AutoPolicy
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import RequestMeta, StreamLogger
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import ProposerResources
from specops.streams import StreamConfig
from specops.streams.codec import decode, encode
from specops.trainer.policy_fit import fit_priors
from tests.conftest import random_prompts


def test_decisions_are_logged_fitted_registered_and_loaded(close_pair, tmp_path, sqlite_uri, capsys):
    url = f"local://{tmp_path}/log"
    logger = StreamLogger(StreamConfig(url=url, fsync=False, num_partitions=2), vocab_size=close_pair.vocab_size)
    engine = SpecEngine(close_pair, logger=logger)
    policy = AutoPolicy(seed=0)
    for i, prompt in enumerate(random_prompts(4, seed=6)):
        cluster = "code" if i % 2 else "prose"
        plain_generate(
            engine,
            prompt,
            SamplingParams(max_new_tokens=16),
            method="auto",
            resources=ProposerResources(pair=close_pair, policy=policy, cluster=cluster),
            meta=RequestMeta(request_id=f"r{i}", cluster=cluster),
        )
    plain_generate(
        engine, [1, 2, 3], SamplingParams(max_new_tokens=8), method="target", meta=RequestMeta(request_id="t")
    )
    logger.close()

    gens = list(read_generations(url))
    assert len(gens) == 5
    autos = [g for g in gens if g.method == "auto"]
    assert len(autos) == 4 and all(g.policy["methods"] and "counts" in g.policy for g in autos)
    assert next(g for g in gens if g.method == "target").policy == {}
    assert decode(encode(autos[0])).policy == autos[0].policy  # the optional field round-trips

    priors, report, used = fit_priors(gens)
    assert used == 4 and set(report) == {"code", "prose"}
    assert sum(r.requests for r in report.values()) == 4
    assert {row["cluster"] for row in priors["counts"]} <= {"code", "prose"}

    out = tmp_path / "priors.json"
    rc = main(
        [
            "policy",
            "fit",
            "--stream",
            url,
            "--out",
            str(out),
            "--register",
            "--promote",
            "--registry",
            sqlite_uri,
            "--json",
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["requests"] == 4 and printed["version"] == "1" and printed["promoted"]
    fresh = AutoPolicy()
    fresh.load_priors(json.loads(out.read_text()))
    assert any(c == "code" for c, _, _ in fresh.counts)

    from specops.registry import RegistryConfig, RegistryStore

    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    v = reg.artifact("policy").by_alias("", "champion")
    assert v is not None and v.version == "1"
    dest = tmp_path / "fetched"
    reg.artifact("policy").fetch(v, dest)
    assert json.loads((dest / "priors.json").read_text())["counts"] == json.loads(out.read_text())["counts"]

    # serving's start: policy@champion's priors, fetched into its cache
    from specops.serving.replica import Replica

    state = Replica.__new__(Replica)
    state.registry, state.cache_dir = reg, tmp_path / "serve-cache"
    served = AutoPolicy()
    state._load_policy_priors(served)
    assert served.counts.keys() == fresh.counts.keys()


def test_no_auto_traffic_fits_nothing(tmp_path, capsys):
    url = f"local://{tmp_path}/empty"
    assert main(["policy", "fit", "--stream", url]) == 0
    assert "nothing to fit" in capsys.readouterr().out
