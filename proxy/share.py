"""Keyed, stable membership of request keys in shares of traffic (the canary share, the shadow's
mirroring share, fault experiments' shares).

The key (``canary.key``, else the request id) is the client's to choose, so membership MUST NOT be
computable by the client: it is HMAC-SHA256 of the key under a per-deployment secret. Every
replica that shares the secret gives one key the same answer; without a configured secret each
pod draws its own at start. Each share draws with its own scope, so one share says nothing about
another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import secrets

from proxy.call import Call

_PER_PROCESS_SECRET = (bytes.fromhex(os.environ["MMGUARD_POD_SECRET"])
                       if os.environ.get("MMGUARD_POD_SECRET") else secrets.token_bytes(32))
"""Used when no secret is configured: stable for this process's life (reloads included); the
workers of one pod get the same one from their supervisor, so they agree on membership."""


class ShareHash:
    """Stable, keyed membership of request keys in shares of traffic."""

    def __init__(self, secret: bytes | None = None, key_header: str = "x-request-id") -> None:
        self.secret = _PER_PROCESS_SECRET if secret is None else secret
        self.key_header = key_header.lower()
        self._draw = random.SystemRandom()

    @property
    def per_process(self) -> bool:
        return self.secret is _PER_PROCESS_SECRET

    def request_key(self, call: Call) -> str:
        """The key a call's membership is decided on: ``canary.key``'s header, else its id."""
        return call.headers.get(self.key_header) or call.id

    def in_share(self, scope: str, key: str, share: float) -> bool:
        """Whether ``key`` falls in ``share`` (0..1) of keys within ``scope`` (which keeps one
        share independent of another); a fresh unpredictable draw for an empty key."""
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        if not key:
            return self._draw.random() < share
        mac = hmac.new(self.secret, f"{scope}\x00{key}".encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") / 2**64 < share
