"""Share membership: keyed (HMAC-SHA256 under the deployment's secret), stable per key, the same
in every replica that has the secret, independent between scopes, and a fresh draw without a
key."""

from __future__ import annotations

import hashlib

from proxy.call import Call
from proxy.share import ShareHash


def _members(shares: ShareHash, scope: str = "canary", share: float = 0.1) -> set[str]:
    return {k for k in (f"id-{i}" for i in range(5000)) if shares.in_share(scope, k, share)}


def test_replicas_with_one_secret_agree_and_another_secret_does_not() -> None:
    a, b = ShareHash(b"deployment secret"), ShareHash(b"deployment secret")
    other = ShareHash(b"another deployment")
    members = _members(a)
    assert members == _members(b)
    assert 400 < len(members) < 600  # 10 % of 5,000
    overlap = len(members & _members(other))
    assert overlap < 100, overlap  # independent: ~50 expected, 500 if the secret did not count


def test_membership_is_not_the_public_hash() -> None:
    def public(key: str) -> bool:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                              "big") / 2**64 < 0.1
    public_members = {k for k in (f"id-{i}" for i in range(5000)) if public(k)}
    assert len(_members(ShareHash(b"s")) & public_members) < 100


def test_scopes_are_independent_and_bounds_hold() -> None:
    shares = ShareHash(b"s")
    assert len(_members(shares, "canary") & _members(shares, "shadow:m")) < 100
    assert shares.in_share("x", "any", 1.0) and not shares.in_share("x", "any", 0.0)
    draws = [shares.in_share("x", "", 0.5) for _ in range(400)]
    assert 100 < sum(draws) < 300  # no key: a fresh draw each time, not a fixed answer


def test_without_a_secret_each_process_has_its_own_and_keeps_it() -> None:
    first, second = ShareHash(), ShareHash()
    assert first.per_process and not ShareHash(b"s").per_process
    assert _members(first) == _members(second)  # one process: reloads keep membership


def test_the_key_is_the_configured_header_else_the_request_id() -> None:
    shares = ShareHash(b"s", key_header="X-Session")
    call = Call(model="m", version="", inputs=[], id="body-id")
    assert shares.request_key(call) == "body-id"
    call.headers = {"x-session": "abc", "x-request-id": "ignored"}
    assert shares.request_key(call) == "abc"
