"""Canary comparison and verdict: does the canary answer like production, and may it replace it?

Guards against promoting a canary that answers differently from production while looking healthy
(fast, no errors): a re-exported model whose logits drift, a quantised build that flips the top
class, an LLM whose answers change. The ``shadow`` filter mirrors a share of a route's traffic to
the canary and hands each pair of answers to the pure functions below; a ``Verdict`` over a sliding
window of those comparisons says promote / hold / abort. Seed scenario: a canary must keep a
correctness SLI of ≥ 99.5 % agreement with production before it takes traffic, and is aborted
(mirroring and any fault experiment stopped) when agreement falls under 95 % or its p99 latency
is 1.5× production's.

No I/O here, and time comes from an injected clock: everything is tested deterministically.
"""

from __future__ import annotations

from filters.compare.answers import (
    CompareConfig,
    Comparison,
    State,
    compare,
    compare_status,
    compare_tensors,
    compare_text,
    normalise,
    openai_text,
    token_f1,
)
from filters.compare.verdict import (
    Verdict,
    VerdictConfig,
)

__all__ = [
    "CompareConfig",
    "Comparison",
    "State",
    "Verdict",
    "VerdictConfig",
    "compare",
    "compare_status",
    "compare_tensors",
    "compare_text",
    "normalise",
    "openai_text",
    "token_f1",
]
