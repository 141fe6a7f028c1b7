"""The whole loop on tiny models, through the HTTP API: records flow, the trainer updates,
the registry promotes, serving swaps, and acceptance on a repeated prompt set goes up.

Deterministic: fixed seeds, greedy decoding, requests sent one at a time, and the trainer
run to completion between the "before" and "after" measurements.
"""

from __future__ import annotations

import shutil
import time

import openai
import pytest
import torch

from specops.cli.serve_runtime import Server
from specops.core.models import load_model_dir
from specops.registry import CHAMPION, RegistryConfig, RegistryStore
from specops.serving.fleet.events import EventPublisher
from specops.serving.http.config import ServeConfig
from specops.streams import StreamConfig, open_stream
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.promote import PromoteConfig, Promoter
from tests.conftest import perturbed, random_prompts

pytestmark = pytest.mark.slow  # the whole loop through the API

CLUSTER = "loop"
MAX_TOKENS = 16
ROUNDS = 8


def _alpha(client: openai.OpenAI, prompts: list[list[int]], rnd: int) -> tuple[float, set[str], list[str]]:
    """Token-weighted acceptance over the prompt set, the draft versions used, and the texts.

    Requests carry fixed ``X-Request-Id``s: the trainer's held-out split hashes them, so the
    split, and with it every number below, is the same on every run."""
    drafted = accepted = 0
    versions, texts = set(), []
    for i, p in enumerate(prompts):
        r = client.completions.create(
            model="specops",
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"cluster": CLUSTER, "speculation": {"method": "draft", "k": 4}},
            extra_headers={"X-Request-Id": f"loop-{rnd}-{i}"},
        )
        spec = r.model_extra["speculation"]
        drafted += spec["drafted"]
        accepted += spec["accepted"]
        versions.add(spec["draft_version"])
        texts.append(r.choices[0].text)
    return accepted / drafted, versions, texts


def test_closed_loop_raises_acceptance(tiny_models, sqlite_uri, tmp_path):
    torch.manual_seed(0)
    pair = load_model_dir(tiny_models)
    draft_dir = tmp_path / "draft"  # a weak draft: the target with noise on every weight
    perturbed(pair.target, 1.0, seed=4).save_pretrained(draft_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models / "target" / f, draft_dir / f)
    stream_url = f"local://{tmp_path / 'streams'}"
    cfg = ServeConfig(
        target=str(tiny_models / "target"),
        draft=str(draft_dir),
        port=0,
        stream=stream_url,
        registry=sqlite_uri,
        router="none",
        clusters=[CLUSTER],
        poll_s=1.0,
        auto_rollback=False,
        max_concurrency=1,
    )
    server = Server(cfg, root=tmp_path).start()
    try:
        server.wait_ready(120)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompts = random_prompts(8, seed=11, lo=6, hi=14, vocab=pair.vocab_size)
        alpha_before, versions, texts_before = _alpha(client, prompts, 0)
        assert versions == {"base"}
        for rnd in range(1, 1 + ROUNDS):  # traffic: the same prompt set, ROUNDS more times
            _alpha(client, prompts, rnd)
        assert server.state.logger.flush(30)

        # records flowed: one MissRecord per rejected position and one GenerationRecord per request
        stream_cfg = StreamConfig(url=stream_url)
        with open_stream(stream_cfg) as s:
            assert len(list(s.read(stream_cfg.topics.generations, timeout_s=1.0))) == (1 + ROUNDS) * len(prompts)
            assert len(list(s.read(stream_cfg.topics.misses, timeout_s=1.0))) > 0

        # the trainer: updates, registers, gates (it must beat the base draft on held-out records), promotes
        registry = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=EventPublisher(stream_cfg))
        out = tmp_path / "trainer"
        trainer = OnlineTrainer(
            stream_cfg,
            draft_dir,
            out,
            OnlineConfig(positions="rejected", interval=8, holdout_every=4, lr=5e-4, poll_records=100_000),
            promoter=Promoter(
                registry,
                draft_dir,
                out,
                PromoteConfig(margin=0.0, min_positions=1),
                tokenizer_dir=tiny_models / "target",
            ),
        )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the same float reduction order on every run: a reproducible update
        try:
            trainer.run(max_idle_s=1.0)
        finally:
            torch.set_num_threads(threads)
            trainer.close()
        champion = registry.artifact("draft").by_alias(CLUSTER, CHAMPION)
        gates = [(v.version, v.tags.get("gate_reason")) for v in registry.artifact("draft").versions(CLUSTER)]
        assert champion is not None, f"the gate promoted nothing: {gates}"
        assert champion.tags["gate_decision"] == "promoted"

        # serving swaps to the champion (pushed by the promotion event, or at the next poll)
        slot = server.state.follower.slot(CLUSTER)
        deadline = time.monotonic() + 60
        while slot.current().version != champion.version and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slot.current().version == champion.version

        alpha_after, versions, texts_after = _alpha(client, prompts, ROUNDS + 1)
        assert versions == {champion.version}
        assert texts_after == texts_before  # lossless: the target's greedy output, whatever the draft
        assert alpha_after >= alpha_before + 0.08, (alpha_before, alpha_after)  # 0.411 -> 0.532 here
    finally:
        server.stop()
