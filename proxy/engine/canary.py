"""Which calls are canary traffic.

The runtime marks every call once, before its route's chain runs (``call.state[CANARY]``), so
every filter agrees on it and fault experiments can test one flag. A call is canary when all of
``canary.headers`` match, or when its key falls in ``canary.share``.

The key (``canary.key``, else the request id) is the client's to choose, so membership of a share
MUST NOT be computable by the client: it is HMAC-SHA256 of the key under a per-deployment secret
(``canary.secret_file`` / ``canary.secret_env``). Every replica that shares the secret gives one
key the same answer, and a retried request keeps its treatment; without a configured secret each
process draws its own at start (membership is then per replica, which the start-up log says).
The shadow filter's mirroring share and the fault experiments' shares draw through the same
``ShareHash``, each with its own prefix, so one share says nothing about another.

Clients' copies of the canary headers are removed before anything reads them unless the
listener trusts them: an untrusted client cannot opt itself into fault injection. Nor can it
learn its treatment: the headers that reveal it (``TREATMENT``) reach only clients of a listener
that shows treatment (``listeners.*.treatment_headers``, by default as trusted as its canary
headers), so an attacker cannot search for a mirrored or faulted request key.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from proxy.call import CANARY, SHOW_TREATMENT, Call, headers_match
from proxy.pod.state import POD, Role
from proxy.share import ShareHash

if TYPE_CHECKING:
    from proxy.config.model import Config

log = logging.getLogger("mmguard.canary")

class CanaryMatcher:
    def __init__(self, config: Config, share_hash: ShareHash) -> None:
        self.cfg = config.canary
        self.headers = {k.lower(): v for k, v in self.cfg.headers.items()}
        lc = config.listeners
        self.trusted = {"grpc": lc.grpc.trust_canary_headers,
                        "http": lc.http.trust_canary_headers,
                        "openai": lc.http.trust_canary_headers}
        self.shown = {"grpc": lc.grpc.shows_treatment, "http": lc.http.shows_treatment,
                      "openai": lc.http.shows_treatment}
        self.share_hash = share_hash

    def mark(self, call: Call) -> bool:
        if CANARY in call.state:  # a reroute or a fallback level: decided once per call
            return bool(call.state[CANARY])
        call.state[SHOW_TREATMENT] = self.shown.get(call.front, False)
        if self.headers and not self.trusted.get(call.front, False):
            for name in self.headers:
                call.headers.pop(name, None)
        canary = bool(self.headers) and headers_match(self.headers, call.headers)
        if not canary and self.cfg.share > 0:
            canary = self.share_hash.in_share("canary", self.share_hash.request_key(call),
                                              self.cfg.share)
        call.state[CANARY] = canary
        return canary


def share_hash_for(config: Config) -> ShareHash:
    """The ``ShareHash`` of ``config`` (its secret read now); ValueError naming the source when
    a configured secret cannot be read."""
    secret = config.canary.resolve_secret()
    return ShareHash(None if secret is None else secret.encode(), config.canary.key)


def log_membership(share_hash: ShareHash) -> None:
    if share_hash.per_process and POD.role is Role.SUPERVISOR:
        log.info("canary.secret_file / canary.secret_env is not set: share membership is keyed "
                 "with a random secret this pod's workers share; it differs between pods and "
                 "restarts")
    elif share_hash.per_process:
        log.info("canary.secret_file / canary.secret_env is not set: share membership "
                    "(canary share, shadow percent, experiment shares) is keyed with a random "
                    "per-process secret, so it differs between replicas and restarts")
    else:
        log.info("share membership is keyed with the configured canary secret")
