"""A client that picks its own request ids cannot put itself into the canary share.

Before, membership was blake2b(x-request-id) < share: anyone could compute it, find an in-share
id in ~100 tries offline and get faults injected (or its request mirrored) 20 times out of 20.
Now it is HMAC-SHA256 under the deployment's secret: the ids an attacker finds in-share under any
public hash are in-share only at the configured base rate, while one id keeps its membership
over retries (a retried request keeps its treatment), by header and by the body's ``id`` alike.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ort_config
from tests.support.adversary import PROBE_PATH, serve
from tests.support.process import MmguardProcess

SHARE = 0.01
ATTEMPTS = 2000


def _public_in_share(key: str) -> bool:
    """The unkeyed membership an attacker can compute (mmguard's former rule)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < SHARE


@pytest.fixture(scope="module")
def canary_served(ort_models: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[MmguardProcess]:
    tmp = tmp_path_factory.mktemp("canary")
    (tmp / "secret").write_text("a per-deployment secret the clients never see\n")
    fault = {"fault": {"experiments": [{"name": "mark", "actions": [{"kind": "delay",
                                                                     "ms": 0}]}]}}
    cfg = ort_config(ort_models, canary={"share": SHARE, "secret_file": str(tmp / "secret")})
    # The attacker is given its treatment here (mmguard-fault), which an untrusted listener
    # never shows (test_treatment.py): even knowing it, it cannot choose it.
    cfg["listeners"] = {"http": {"treatment_headers": True}}
    cfg["models"] = [{"name": "identity_fp32", "backend": "ort", "filters": [fault]}]
    with serve(tmp, cfg) as proc:
        yield proc


class Client:
    """One keep-alive connection; tells whether a call was treated as canary (faulted)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def faulted(self, request_id: str, in_body: bool = False) -> bool:
        doc: dict[str, object] = {"inputs": [{"name": "INPUT0", "datatype": "FP32",
                                              "shape": [1], "data": [1.0]}]}
        headers = {"Content-Type": "application/json"}
        if in_body:
            doc["id"] = request_id
        else:
            headers["x-request-id"] = request_id
        self.conn.request("POST", PROBE_PATH, json.dumps(doc).encode(), headers)
        r = self.conn.getresponse()
        body = r.read()
        assert r.status == 200, body
        fault = r.getheader("mmguard-fault")
        assert fault is None or fault.startswith("mark/delay"), fault
        return fault is not None


def test_ids_found_in_share_offline_are_in_share_only_at_the_base_rate(
        canary_served: MmguardProcess) -> None:
    # The attack: search ids offline until 2,000 of them are in the share by the public hash.
    found = [key for key in (f"attacker-{i}" for i in range(1_000_000))
             if _public_in_share(key)][:ATTEMPTS]
    assert len(found) == ATTEMPTS
    client = Client(canary_served.ports["http"])
    try:
        _attack(client, found)
    finally:
        client.conn.close()


def _attack(client: Client, found: list[str]) -> None:
    members = [key for key in found if client.faulted(key)]
    # Expected 1 % of 2,000 = 20 (the public hash would have given 2,000). Binomial bounds:
    # fewer than 1 or more than 60 has a probability under 1e-8 with a keyed hash.
    assert 1 <= len(members) <= 60, f"{len(members)} of {ATTEMPTS} ids were canary"
    print(f"{len(members)} of {ATTEMPTS} ids in-share by the public hash were canary")

    # Retries keep their membership: every member stays in, as many non-members stay out.
    outsiders = [key for key in found if key not in members][:len(members)]
    for _ in range(3):
        assert all(client.faulted(key) for key in members)
        assert not any(client.faulted(key) for key in outsiders)
    # The body's id is the key when there is no header: the same membership.
    assert all(client.faulted(key, in_body=True) for key in members)
    assert not any(client.faulted(key, in_body=True) for key in outsiders)
