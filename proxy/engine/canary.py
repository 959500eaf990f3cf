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

With ``canary.eligible`` (the source documents' gray release: "alignment above 0.85 first"), a
call in the share becomes canary traffic only once a filter has published scores on it
(``publish_scores``) that meet every condition; until then, and for a call never scored, it is
not canary and not eligible (``CANARY_ELIGIBLE``, which the shadow's mirroring reads too).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import Counter

from proxy.call import (
    CANARY,
    CANARY_ELIGIBLE,
    CANARY_GATE,
    CANARY_POPULATION,
    SCORES,
    SHOW_TREATMENT,
    Call,
    headers_match,
)
from proxy.pod.state import POD, Role
from proxy.share import ShareHash

if TYPE_CHECKING:
    from proxy.config.model import Config
    from proxy.telemetry import Telemetry

log = logging.getLogger("mmguard.canary")

class CanaryMatcher:
    def __init__(self, config: Config, share_hash: ShareHash,
                 telemetry: Telemetry | None = None) -> None:
        self.cfg = config.canary
        self.population = " and ".join(str(e) for e in self.cfg.eligible)
        self.m_calls = self.m_eligible = None
        if telemetry is not None and self.cfg.eligible:
            self.m_calls = telemetry.metric(
                Counter, "mmguard_canary_eligibility_calls_total",
                "Calls judged for canary eligibility (canary.eligible).", ["model"])
            self.m_eligible = telemetry.metric(
                Counter, "mmguard_canary_eligibility_judged_total",
                "Calls whose published scores were judged, by result: eligible true / false "
                "(calls minus judged: no score published, not eligible).", ["model", "eligible"])
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
        in_share = False
        if not canary and self.cfg.share > 0:
            in_share = self.share_hash.in_share("canary", self.share_hash.request_key(call),
                                                self.cfg.share)
        if self.cfg.eligible:
            # Not eligible until a filter publishes scores that meet every condition; then
            # (and only then) a call in the share becomes canary traffic.
            call.state[CANARY_ELIGIBLE] = False
            call.state[CANARY_POPULATION] = self.population
            call.state[CANARY_GATE] = lambda c: self._admit(c, in_share)
            if self.m_calls is not None:
                self.m_calls.labels(call.model).inc()
        else:
            canary = canary or in_share
        call.state[CANARY] = canary
        return canary

    def _admit(self, call: Call, in_share: bool) -> None:
        scores = call.state.get(SCORES) or {}
        if any(e.score not in scores for e in self.cfg.eligible):
            return  # another filter's scores may still come
        call.state[CANARY_GATE] = _judged  # once per call, however often scores come
        ok = all((scores[e.score] >= e.at_least) if e.at_least is not None
                 else (scores[e.score] < (e.below or 0.0)) for e in self.cfg.eligible)
        call.state[CANARY_ELIGIBLE] = ok
        if ok and in_share:
            call.state[CANARY] = True
        if self.m_eligible is not None:
            self.m_eligible.labels(call.model, str(ok).lower()).inc()


def _judged(call: Call) -> None:
    """The gate of a call already judged."""


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
