"""``shadow``: mirror a share of a route's traffic to a canary route, compare every answer with
production's, and give a verdict (promote / hold / abort) over a sliding window.

Rules that MUST hold:

- The primary is never delayed or failed by the shadow: the copy goes on a bounded queue after
  the primary has its answer (put without waiting); a full queue drops the copy and counts it.
  Workers send copies to the canary route through its own chain, off the request path.
- The copy is the request as the client sent it (taken before inner filters edit the call), and
  it is canary traffic (``CANARY`` set): fault experiments on the canary route apply to it.
- Each comparison (``filters.compare``) feeds the verdict; an abort verdict stops the mirroring
  and the fault experiments on both routes, and says why (log, metric, admin API).
- Noise floor: a share of the mirrored calls is also sent a second time to the primary, so a
  non-deterministic model is judged against its own disagreement, not against zero.
- Streams (OpenAI SSE) are compared on the assembled text once the client's stream has ended.
"""

from __future__ import annotations

from filters.shadow.config import (
    OnAbort,
    ShadowConfig,
)
from filters.shadow.filter import (
    Shadow,
    ShadowFactory,
)
from filters.shadow.state import ShadowState

__all__ = [
    "OnAbort",
    "Shadow",
    "ShadowConfig",
    "ShadowFactory",
    "ShadowState",
]
