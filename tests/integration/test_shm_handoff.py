"""Shared-memory hand-off to a co-located real Triton (``shared_memory: system`` on the gRPC
backend): the same answers as direct, byte for byte; slots registered once and sized from the
contracts; a call that does not fit goes inline; Triton restarted → slots registered again;
mmguard stopped → slots unregistered and their files gone. The pool's counts are read off the
admin /metrics as an operator scrapes them."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from proxy.backends.shm_handoff import INLINE_REASONS, HandoffPool
from proxy.backends.triton_grpc import TritonGrpcBackend
from proxy.backends.triton_http import TritonHttpBackend
from proxy.cli.demo_model import ensure_clip_demo
from tests.support.mmguard import RunningMmguard
from tests.support.triton import DECOUPLED_MODELS, MODEL_NAMES, TritonServer, write_model_repository

MODELS = [m for m in MODEL_NAMES if m not in DECOUPLED_MODELS]


@pytest.fixture(scope="module")
def own_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A Triton of this module's own: one test restarts it."""
    root = tmp_path_factory.mktemp("handoff_triton")
    repo = write_model_repository(root / "repo", ensure_clip_demo(root / "onnx"))
    with TritonServer(repo, root / "work") as server:
        yield server


@pytest.fixture(params=["triton_grpc", "triton_http"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def handoff_config(triton: TritonServer, kind: str, **pool: Any) -> dict[str, Any]:
    url = triton.grpc_url if kind == "triton_grpc" else triton.http_url
    return {"backends": [{"kind": kind, "name": "triton", "url": url,
                          "shared_memory": "system", "shared_memory_pool": pool}],
            "models": [{"name": m, "backend": "triton"} for m in MODELS]}


def pool_of(proxy: RunningMmguard) -> HandoffPool:
    assert proxy.server is not None
    backend = proxy.server.plane.runtime.backends["triton"]
    assert isinstance(backend, TritonGrpcBackend | TritonHttpBackend)
    assert backend.handoff is not None
    return backend.handoff


def handoff_metrics(proxy: RunningMmguard) -> dict[str, float]:
    """The backend's ``mmguard_shm_handoff_*`` samples from the admin /metrics, keyed by name
    plus the label that is not ``backend`` (``inline_total{reason=too_big}`` → ``inline.too_big``,
    ``registrations_total{result=ok}`` → ``registrations.ok``)."""
    text = urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("mmguard_shm_handoff_"):
                continue
            assert sample.labels.pop("backend") == "triton", sample
            key = sample.name.removeprefix("mmguard_shm_handoff_").removesuffix("_total")
            out[".".join([key, *sample.labels.values()])] = sample.value
    return out


def triton_regions(triton: TritonServer) -> dict[str, int]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        status = client.get_system_shared_memory_status()
        return {r.name: int(r.byte_size) for r in status.regions.values()
                if r.name.startswith("mmguard_")}
    finally:
        client.close()


CASES: list[tuple[str, dict[str, np.ndarray[Any, Any]], list[str] | None]] = [
    ("small_fp32", {"x": np.arange(16, dtype=np.float32).reshape(1, 16)}, ["y"]),
    ("clip_demo", {"pixel_values": np.random.default_rng(3).random((2, 3, 224, 224),
                                                                    dtype=np.float32),
                   "input_ids": np.arange(154, dtype=np.int64).reshape(2, 77) % 50}, None),
    ("identity_fp32", {"INPUT0": np.linspace(-1, 1, 1000, dtype=np.float32).reshape(1, -1)},
     None),
    ("identity_bytes", {"INPUT0": np.array([[b"a\x00b", b"", b"xyz"]], dtype=np.object_)},
     None),
]


def infer(url: str, model: str, inputs: dict[str, np.ndarray[Any, Any]],
          outputs: list[str] | None) -> list[tuple[str, bytes]]:
    """(name, bytes) of every output, in the order the answer lists them."""
    client = grpcclient.InferenceServerClient(url)
    try:
        ins = []
        for name, arr in inputs.items():
            datatype = "BYTES" if arr.dtype == np.object_ else \
                {np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type]
            inp = grpcclient.InferInput(name, list(arr.shape), datatype)
            inp.set_data_from_numpy(arr)
            ins.append(inp)
        outs = None if outputs is None else [grpcclient.InferRequestedOutput(o) for o in outputs]
        resp = client.infer(model, ins, outputs=outs).get_response()
        return [(o.name, bytes(raw)) for o, raw in zip(resp.outputs, resp.raw_output_contents,
                                                       strict=True)]
    finally:
        client.close()


def test_same_answers_as_direct_through_slots(own_triton: TritonServer, kind: str) -> None:
    with RunningMmguard(handoff_config(own_triton, kind)) as proxy:
        proxy.wait_ready()
        before = handoff_metrics(proxy)  # every count there at 0 before the first call
        assert before == {"calls": 0, "registrations.ok": 0, "registrations.failed": 0,
                          "reregistrations": 0, "slots": 0, "slots_in_use": 0, "slot_bytes": 0,
                          **{f"inline.{r}": 0 for r in INLINE_REASONS}}, before
        for model, inputs, outputs in CASES:
            direct = infer(own_triton.grpc_url, model, inputs, outputs)
            assert infer(proxy.grpc_url, model, inputs, outputs) == direct, model
        pool = pool_of(proxy)
        assert pool.stats.get("shm") == len(CASES), pool.stats
        after = handoff_metrics(proxy)
        assert after == {**before, "calls": len(CASES), "registrations.ok": 1, "slots": 16,
                         "slot_bytes": pool.all[0].size}, after
        # Registered once, sized from the contracts: clip_demo at max batch is the largest.
        regions = triton_regions(own_triton)
        assert len(regions) == 16 and set(regions.values()) == {pool.all[0].size}
        assert pool.all[0].size >= 2 * 3 * 224 * 224 * 4
        # HTTP clients go the same way (the front re-encodes what the slot gave back).
        http = httpclient.InferenceServerClient(proxy.http_url)
        x = httpclient.InferInput("x", [1, 16], "FP32")
        x.set_data_from_numpy(np.ones((1, 16), np.float32))
        np.testing.assert_array_equal(http.infer("small_fp32", [x]).as_numpy("y"),
                                      np.full((1, 16), 2, np.float32))
        http.close()
        files = [Path(s.path) for s in pool.all]
        assert all(f.exists() for f in files)
    assert triton_regions(own_triton) == {}  # unregistered on stop
    assert not any(f.exists() for f in files)


def test_a_call_that_does_not_fit_goes_inline(own_triton: TritonServer, kind: str) -> None:
    with RunningMmguard(handoff_config(own_triton, kind, slots=2,
                                       max_slot_bytes=64 * 1024)) as proxy:
        proxy.wait_ready()
        big = {"INPUT0": np.arange(40_000, dtype=np.float32).reshape(1, -1)}  # 160 KB > 64 KB
        assert infer(proxy.grpc_url, "identity_fp32", big, None) == \
            infer(own_triton.grpc_url, "identity_fp32", big, None)
        stats = pool_of(proxy).stats
        assert stats.get("inline_too_big") == 1 and "shm" not in stats
        seen = handoff_metrics(proxy)
        assert (seen["inline.too_big"], seen["calls"], seen["slots"], seen["slot_bytes"]) == \
            (1, 0, 2, 64 * 1024), seen
        small = CASES[0]
        assert infer(proxy.grpc_url, *small) == infer(own_triton.grpc_url, *small)
        seen = handoff_metrics(proxy)
        assert (seen["inline.too_big"], seen["calls"], seen["slots_in_use"]) == (1, 1, 0), seen


def test_slots_are_registered_again_after_triton_restarts(own_triton: TritonServer,
                                                          kind: str) -> None:
    case = CASES[0]
    with RunningMmguard(handoff_config(own_triton, kind, slots=2)) as proxy:
        proxy.wait_ready()
        want = infer(own_triton.grpc_url, *case)
        assert infer(proxy.grpc_url, *case) == want
        own_triton.stop()
        own_triton.start(keep_ports=True)
        proxy.wait_ready()
        assert triton_regions(own_triton) == {}  # a new Triton knows nothing of them
        assert infer(proxy.grpc_url, *case) == want  # refused by Triton, sent again inline
        assert infer(proxy.grpc_url, *case) == want  # through the slots registered again
        pool = pool_of(proxy)
        assert pool.stats.get("reregister") == 1 and pool.stats.get("shm") == 3, pool.stats
        assert len(triton_regions(own_triton)) == 2
        seen = handoff_metrics(proxy)
        assert {k: seen[k] for k in ("calls", "inline.slot_lost", "reregistrations",
                                     "registrations.ok", "slots", "slots_in_use")} == \
            {"calls": 3, "inline.slot_lost": 1, "reregistrations": 1, "registrations.ok": 2,
             "slots": 2, "slots_in_use": 0}, seen


def test_classification_is_answered_inline_as_direct(own_triton: TritonServer,
                                                     kind: str) -> None:
    x = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]], np.float32)

    def top3(url: str) -> list[bytes]:
        client = grpcclient.InferenceServerClient(url)
        inp = grpcclient.InferInput("x", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        out = grpcclient.InferRequestedOutput("y", class_count=3)
        try:
            return list(client.infer("small_fp32", [inp], outputs=[out]).as_numpy("y")[0])
        finally:
            client.close()

    with RunningMmguard(handoff_config(own_triton, kind)) as proxy:
        proxy.wait_ready()
        direct = top3(own_triton.grpc_url)
        assert len(direct) == 3 and direct[0].startswith(b"18")  # 2 × 9, "score:index"
        assert top3(proxy.grpc_url) == direct
        assert pool_of(proxy).stats.get("shm") == 1  # the input still went through a slot
