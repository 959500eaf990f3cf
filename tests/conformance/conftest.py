"""The conformance tier: the same client code runs against the real Triton directly and through
mmguard (with its Triton gRPC backend and with its Triton HTTP backend), with the same assertions.

A test here takes the ``target`` fixture and talks to ``target.http_url`` / ``target.grpc_url``
with real clients, calling models by their real names (each mmguard serves every model of the
test repository under its own name). A test that passes ``direct`` and fails through mmguard is
a mmguard bug; one that fails ``direct`` is a fixture bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.triton import DECOUPLED_MODELS, MODEL_NAMES, TritonServer


@dataclass(frozen=True)
class Target:
    """Where a conformance client connects: ``label`` is direct, mmguard-grpc or mmguard-http
    (the Triton backend mmguard uses)."""

    label: str
    http_url: str
    grpc_url: str
    proxy: RunningMmguard | None = None

    @property
    def via_mmguard(self) -> bool:
        return self.proxy is not None


def same_name_routes(triton: TritonServer, kind: str) -> dict[str, object]:
    """Every model of the test repository under its own name, through one Triton backend.
    The HTTP backend cannot carry decoupled models (Triton streams them over gRPC only)."""
    url = triton.grpc_url if kind == "triton_grpc" else triton.http_url
    names = [m for m in MODEL_NAMES if kind == "triton_grpc" or m not in DECOUPLED_MODELS]
    return {"backends": [{"kind": kind, "name": "triton", "url": url}],
            "models": [{"name": m, "backend": "triton"} for m in names],
            "shared_memory": {"system": True}}  # Triton serves it by default; mmguard opts in


@pytest.fixture(scope="session")
def conformance_proxies(triton: TritonServer) -> Iterator[dict[str, RunningMmguard]]:
    with RunningMmguard(same_name_routes(triton, "triton_grpc")) as via_grpc, \
            RunningMmguard(same_name_routes(triton, "triton_http")) as via_http:
        via_grpc.wait_ready()
        via_http.wait_ready()
        yield {"mmguard-grpc": via_grpc, "mmguard-http": via_http}


def _target(label: str, triton: TritonServer,
            proxies: dict[str, RunningMmguard]) -> Target:
    if label == "direct":
        return Target(label, triton.http_url, triton.grpc_url)
    proxy = proxies[label]
    return Target(label, proxy.http_url, proxy.grpc_url, proxy)


@pytest.fixture(params=["direct", "mmguard-grpc", "mmguard-http"])
def target(request: pytest.FixtureRequest, triton: TritonServer,
           conformance_proxies: dict[str, RunningMmguard]) -> Target:
    return _target(request.param, triton, conformance_proxies)


@pytest.fixture(params=["direct", "mmguard-grpc"])
def stream_target(request: pytest.FixtureRequest, triton: TritonServer,
                  conformance_proxies: dict[str, RunningMmguard]) -> Target:
    """For decoupled models, which only a gRPC backend can carry."""
    return _target(request.param, triton, conformance_proxies)
