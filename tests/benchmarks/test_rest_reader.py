"""REST's library learns from its queries; the baseline gives each request a fresh reader."""

from __future__ import annotations

import random

from benchmarks.rest_baseline import RestIndex, RestProposer
from specops.serving.engine.types import DecodeState, SamplingParams


def test_a_shared_reader_remembers_queries_and_a_fresh_one_per_request_does_not():
    rng = random.Random(0)
    index = RestIndex([[rng.randrange(1000) for _ in range(200)] for _ in range(20)], 49152)
    novel = [40000 + i for i in range(16)]  # in no document
    reader = index.reader
    assert reader.search(novel[:3], choices=8)[0] == []
    reader.search(novel, choices=8)
    # draftretriever 0.1.1: the reader now drafts the queried string's continuation (a quirk the
    # baseline must not carry from one request to the next).
    assert reader.search(novel[:3], choices=8)[0] != []

    rest = RestProposer(index)
    state = DecodeState(token_ids=list(novel), num_prompt_tokens=16, params=SamplingParams(max_new_tokens=1))
    rest.start(state)
    rest.propose(state, 4)  # asks the reader about the novel context
    later = DecodeState(token_ids=[7, *novel[:3]], num_prompt_tokens=4, params=SamplingParams(max_new_tokens=1))
    rest.start(later)  # the next request: a fresh reader
    assert rest.propose(later, 4).k == 0  # nothing drafted: the novel string is not in the datastore
