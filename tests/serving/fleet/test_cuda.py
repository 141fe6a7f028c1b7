"""A draft hot-swap on a GPU (``pytest -m cuda``): a new version is loaded from its safetensors
directory onto the device (``specops.core.models.load_model``, as ``DraftFollower`` validates and loads a
fetched version) while requests decode on the old one, swapped into the cluster's ``DraftSlot``,
and every request, before, during and after the swap, still equals target-only greedy output.

The registry side of the swap (fetch, checksums, events) needs MLflow, which the GPU machine
lacks; ``tests/serving/fleet/test_hotswap.py`` covers it on the CPU.
"""

from __future__ import annotations

import copy
import threading

import torch

from specops.core.models import ModelPair, load_model
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.hotswap import BASE, DraftHandle, DraftSlot
from specops.serving.plan import plain_generate
from tests import cuda_support as cs
from tests.conftest import random_prompts

pytestmark = cs.MARKS


def test_a_draft_loaded_onto_the_device_swaps_in_under_load(tmp_path):
    pair = cs.close_pair(cs.tiny_target())
    copy.deepcopy(pair.target).cpu().save_pretrained(tmp_path / "v2")  # version 2: the target's twin
    slot = DraftSlot(DraftHandle("code", BASE, pair.draft))
    engine_for = {}  # version -> engine (a request keeps the handle it started with)
    params = SamplingParams(max_new_tokens=24)
    prompts = random_prompts(6, seed=31)
    want = [plain_generate(SpecEngine(pair), p, params, method="target").token_ids for p in prompts]
    results: list[tuple[str, list[int], float]] = []
    errors: list[BaseException] = []
    swapped = threading.Event()

    def serve(rounds: int) -> None:
        try:
            for r in range(rounds):
                for i, prompt in enumerate(prompts):
                    handle = slot.current()
                    engine = engine_for.setdefault(
                        handle.version, SpecEngine(ModelPair(target=pair.target, draft=handle.model, tokenizer=None))
                    )
                    out = plain_generate(engine, prompt, params, method="draft", k=4)
                    results.append((handle.version, out.token_ids, out.stats.acceptance_rate))
                    assert out.token_ids == want[i]
                if swapped.is_set() and r >= 1:
                    return
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    worker = threading.Thread(target=serve, args=(20,))
    worker.start()
    new = load_model(tmp_path / "v2", dtype=pair.draft.dtype, device=cs.DEVICE)  # while requests decode
    assert next(new.parameters()).device.type == torch.device(cs.DEVICE).type
    old = slot.swap(DraftHandle("code", "2", new))
    swapped.set()
    worker.join(300)
    assert not worker.is_alive() and not errors, errors
    assert old.version == BASE and slot.current().version == "2"
    versions = [v for v, _, _ in results]
    assert BASE in versions and "2" in versions
    assert versions.index("2") > 0 and "2" not in versions[: versions.index("2")]  # one swap, no way back
    assert all(rate == 1.0 for v, _, rate in results if v == "2")  # the twin is always accepted
