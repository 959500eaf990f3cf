"""Which calls are canary traffic.

The runtime marks every call once, before its route's chain runs (``call.state[CANARY]``), so
every filter agrees on it and fault experiments can test one flag. A call is canary when all of
``canary.headers`` match, or when its key falls in ``canary.share``. The key hashes stably (the
same ``x-request-id`` is always in or always out), so a retried request keeps its treatment.

Clients' copies of the canary headers are removed before anything reads them unless the
listener trusts them: an untrusted client cannot opt itself into fault injection.
"""

from __future__ import annotations

import hashlib
import random

from proxy.call import CANARY, Call
from proxy.config import Config


class CanaryMatcher:
    def __init__(self, config: Config) -> None:
        self.cfg = config.canary
        self.headers = {k.lower(): v for k, v in self.cfg.headers.items()}
        lc = config.listeners
        self.trusted = {"grpc": lc.grpc.trust_canary_headers,
                        "http": lc.http.trust_canary_headers,
                        "openai": lc.http.trust_canary_headers}
        self.key = self.cfg.key.lower()

    def mark(self, call: Call) -> bool:
        if CANARY in call.state:  # a reroute or a fallback level: decided once per call
            return bool(call.state[CANARY])
        if self.headers and not self.trusted.get(call.front, False):
            for name in self.headers:
                call.headers.pop(name, None)
        canary = bool(self.headers) and all(
            name in call.headers and (want == "*" or call.headers[name] == want)
            for name, want in self.headers.items())
        if not canary and self.cfg.share > 0:
            canary = in_share(call.headers.get(self.key) or call.id, self.cfg.share)
        call.state[CANARY] = canary
        return canary


def in_share(key: str, share: float) -> bool:
    """Stable membership of ``key`` in a ``share`` of keys; random for an empty key."""
    if share >= 1.0:
        return True
    if not key:
        return random.random() < share
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share
