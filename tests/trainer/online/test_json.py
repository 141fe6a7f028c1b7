"""JSON-mode traffic teaches its cluster's draft: the records of requests decoded under a grammar
hold what the target could emit there (the masked distribution), and online distillation on them
raises the draft's held-out acceptance on that traffic."""

from __future__ import annotations

import json

import numpy as np
from transformers import AutoModelForCausalLM

from specops.core.models import load_pair
from specops.serving.engine.grammar import GrammarSpec
from specops.serving.engine.sampling import LOGPROB_FLOOR
from specops.trainer.acceptance import evaluate_records
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from tests.trainer.logged import log_requests
from tests.trainer.online.test_trainer import PAPER_PLUS

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}}},
    "required": ["id", "tags"],
    "additionalProperties": False,
}


def test_a_json_mode_clusters_draft_learns_from_json_mode_traffic(tiny_models, tmp_path):
    pair = load_pair(tiny_models / "target", tiny_models / "draft")
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    cfg, draft_dir = log_requests(
        pair, tmp_path, 32, seed=9, cluster_of=lambda i: "json", partitions=1, grammar=spec, vocab=pair.vocab_size
    )
    out = tmp_path / "trainer"
    trainer = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**PAPER_PLUS, interval=4, holdout_every=4))
    trainer.run(max_idle_s=1.0)
    trainer.close()
    held_out = [h.record for h in trainer.clusters["json"].holdout]
    assert held_out and any(r.num_rejected for r in held_out)
    # what the target saw: the grammar's forbidden tokens sit at the floor, every number finite
    floors = [float(np.min(r.logprobs)) for r in held_out if r.num_rejected]
    assert all(np.isfinite(r.logprobs).all() for r in held_out) and min(floors) == LOGPROB_FLOOR
    before = evaluate_records(AutoModelForCausalLM.from_pretrained(draft_dir), held_out)
    after = trainer.evaluate("json")
    assert after.num_positions == before.num_positions > 0
    assert after.sampling > before.sampling, (before, after)
