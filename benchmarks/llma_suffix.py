"""SuffixDecoding (Snowflake's ``arctic-inference``) as a proposer of our engine, for the LLMA
benchmark's ``suffix`` arm: the same target, verifier and references, a different drafter.

The references go into SuffixDecoding's *global* tree as cached responses (its cache of past
outputs, the source it was made for); the request's prompt and output go into its local tree,
as in its vLLM integration. A draft is its best single path (``use_tree_spec=False``, the
default there) of at most ``k`` tokens. ``arctic-inference`` targets vLLM and builds from
source on CPU only by hand (docs/llma.md says how); the arm is skipped when it does not import.
"""

from __future__ import annotations

from arctic_inference.suffix_decoding import SuffixDecodingCache

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, references: list[list[int]], k: int, max_depth: int = 64) -> None:
        self.k = k
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth)
        for i, doc in enumerate(references):
            rid = f"ref{i}"
            self.cache.start_request(rid, [])
            self.cache.add_active_response(rid, [int(t) for t in doc])
            self.cache.stop_request(rid)
        self._seen = 0

    def start(self, state: DecodeState) -> None:
        self.cache.start_request("req", list(state.token_ids))
        self._seen = len(state.token_ids)

    def propose(self, state: DecodeState, k: int) -> Proposals:
        toks = state.token_ids
        if len(toks) > self._seen:
            self.cache.add_active_response("req", list(toks[self._seen :]))
            self._seen = len(toks)
        draft = self.cache.speculate("req", list(toks[-self.cache.max_tree_depth :]), max_spec_tokens=min(k, self.k))
        return Proposals.from_rows([list(draft.token_ids)]) if draft.token_ids else Proposals.empty()

    def rollback(self, state: DecodeState, position: int) -> None:
        self._seen = min(
            self._seen, position
        )  # the local tree keeps the withdrawn tokens (a rare, harmless extra match)
