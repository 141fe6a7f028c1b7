"""Step costs of a model as the engine runs it: a cached forward of ``n`` new tokens.

``c`` in OSD Eq. 2 is a draft's 1-token step over the target's; a verification step feeds
``k + 1`` tokens. Both are measured here the same way everywhere (the bootstrap's
``manifest.json`` and ``benchmarks/spec_decode.py``): median wall time through ``CachedLM``
after a cached context, the cache rolled back after every step.
"""

from __future__ import annotations

import statistics
import time

from transformers import PreTrainedModel

from specops.serving.engine.kv import CachedLM


def step_ms(model: PreTrainedModel, context_ids: list[int], n: int = 1, *, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of one cached forward of ``n`` new tokens after ``context_ids``."""
    assert context_ids and n >= 1 and reps >= 1
    lm = CachedLM(model)
    lm.forward(context_ids, logits_to_keep=1)
    base = lm.num_cached
    feed = (context_ids * n)[:n]
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        lm.forward(feed, logits_to_keep=n)
        elapsed = time.perf_counter() - t0
        lm.rollback(base)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times) * 1000.0
