"""What a vLLM server drafted and accepted, read from its Prometheus ``/metrics``.

vLLM reports speculation per server, not per request: the number of drafts (steps that
drafted), drafted tokens, accepted tokens and accepted tokens per draft position, and the
requests it finished. Since every vLLM server behind the front door serves one draft version
(``specops.serving.vllm.fleet``), the difference of two readings is that version's live acceptance
over the interval, which feeds the same live-acceptance report and auto-rollback as our own
engine's per-request counts (``specops.serving.fleet.hotswap.DraftFollower.record``).

The OSD paper's per-token α from these counters: a draft of k tokens ends in a rejection
unless all k were accepted, and ``accepted_per_pos[k-1]`` counts the drafts whose last token
was accepted, so α = accepted / (accepted + drafts − accepted_per_pos[k−1]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import urllib3

_SAMPLE = re.compile(r"^(vllm:[A-Za-z_:]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$")
_POS = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecCounters:
    requests: float = 0.0
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = field(default_factory=tuple)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0.0,) * (n - len(other.accepted_per_pos))
        return SpecCounters(
            self.requests - other.requests,
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            tuple(a - b for a, b in zip(mine, theirs)),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def alpha_token(self) -> float:
        """OSD's per-token α (see the module docstring); 0 when nothing was drafted."""
        if not self.drafts or not self.accepted_per_pos:
            return 0.0
        rejected_steps = max(self.drafts - self.accepted_per_pos[-1], 0.0)
        total = self.accepted + rejected_steps
        return self.accepted / total if total else 0.0


def parse(text: str) -> SpecCounters:
    """The counters in one ``/metrics`` page (summed over label sets, e.g. model names)."""
    sums = {"requests": 0.0, "drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    per_pos: dict[int, float] = {}
    names = {
        "vllm:request_success": "requests",
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in names:
            sums[names[name]] += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = _POS.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    ordered = tuple(per_pos[i] for i in sorted(per_pos))
    return SpecCounters(accepted_per_pos=ordered, **sums)


def scrape(http: urllib3.PoolManager, url: str, timeout_s: float = 5.0) -> SpecCounters:
    r = http.request("GET", url + "/metrics", timeout=timeout_s, retries=False)
    if r.status != 200:
        raise OSError(f"{url}/metrics answered {r.status}")
    return parse(r.data.decode(errors="replace"))
