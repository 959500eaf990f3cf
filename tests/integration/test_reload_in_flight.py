"""A reload that replaces a backend while calls are in flight on it (a certificate rotation
rebuilds the backend, for one): those calls end as they would have, on the real Triton, over
both of its protocols, even when they outlast the reload's grace; the retired backend closes
once they have."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml

from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config, triton_routes
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request


def _wait_in_flight(m: RunningMmguard, route: str) -> None:
    """Until the call is being served: it holds the old runtime's route from then on (a call
    finds its route and counts itself in flight in one step), whatever the machine's load."""
    deadline = time.monotonic() + 30
    while (m.telemetry.registry.get_sample_value(
            "mmguard_requests_in_flight", {"model": route, "front": "grpc"}) or 0) < 1:
        assert time.monotonic() < deadline, "the call never came in"
        time.sleep(0.01)


def _config(triton: TritonServer, timeout_s: float, shm: str) -> dict[str, Any]:
    cfg = triton_routes(triton, ["slow_fp32"])
    for backend in cfg["backends"]:
        backend["timeout_s"] = timeout_s
        backend["shared_memory"] = shm
    # The old backends close 1 s after the reload: the call is at the model by then (it came
    # in before the reload), and is still there (the model sleeps 3 s).
    return {**cfg, "shutdown_grace_s": 1}


@pytest.mark.parametrize("shm", ["off", "system"])
@pytest.mark.parametrize("route", ["g_slow_fp32", "h_slow_fp32"])
def test_a_call_in_flight_ends_as_it_would_have_across_a_reload_that_replaces_its_backend(
        triton: TritonServer, tmp_path: Path, route: str, shm: str) -> None:
    """``shm: system``: the call's tensors sit in a shared-memory slot the retired backend
    registered with Triton; the slot is unregistered only once the call is done."""
    x = np.array([[1.5, -2.0, 3.25]], np.float32)
    body = grpc_request(route, [("x", "FP32", [1, 3], x.tobytes()),
                                ("delay_ms", "INT32", [1, 1],
                                 np.array([[3000]], "<i4").tobytes())])
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(_config(triton, 30, shm)))
    with RunningMmguard(_config(triton, 30, shm), config_path=path) as m:
        assert m.server is not None
        m.wait_ready(timeout=60)
        backend = "triton-grpc" if route.startswith("g_") else "triton-http"
        old = m.server.plane.runtime.backends[backend]
        answers: list[Any] = []

        def call() -> None:
            try:
                answers.append(grpc_infer_raw(m.grpc_url, body))
            except grpc.RpcError as exc:
                answers.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        _wait_in_flight(m, route)
        path.write_text(yaml.safe_dump(_config(triton, 20, shm)))  # both backends built anew
        assert m.run(m.server.reload())
        assert m.server.plane.runtime.backends[backend] is not old
        caller.join(30)
        if shm == "system":  # the call went through a slot, not inline
            assert old.handoff.stats.get("shm") == 1, old.handoff.stats  # type: ignore[attr-defined]
        assert len(answers) == 1
        answer = answers[0]
        assert not isinstance(answer, grpc.RpcError), (
            f"the call in flight was cut by the reload: {answer.code()} {answer.details()}")
        reply = pb.ModelInferResponse.FromString(answer[0])
        y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, 3)
        np.testing.assert_array_equal(y, x)


def test_a_call_grpc_cancels_under_mmguard_is_answered_and_names_why(
        triton: TritonServer) -> None:
    """Past that wait grpc cancels the channel's calls: the client is answered UNAVAILABLE
    at once, naming the backend and the reload (a CancelledError let through left it waiting
    for its own deadline with no answer)."""
    body = grpc_request("g_slow_fp32", [("x", "FP32", [1, 1], b"\0\0\0\0"),
                                        ("delay_ms", "INT32", [1, 1],
                                         np.array([[3000]], "<i4").tobytes())])
    with RunningMmguard(_config(triton, 30, "off")) as m:
        assert m.server is not None
        m.wait_ready(timeout=60)
        backend = m.server.plane.runtime.backends["triton-grpc"]
        answers: list[Any] = []

        def call() -> None:
            try:
                answers.append(grpc_infer_raw(m.grpc_url, body, timeout=20))
            except grpc.RpcError as exc:
                answers.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        _wait_in_flight(m, "g_slow_fp32")

        async def cut() -> None:
            for channel in backend._channels:  # type: ignore[attr-defined]
                await channel.close()  # no grace: what the wait ends in

        m.run(cut())
        caller.join(10)
        assert not caller.is_alive(), "the client was left waiting"
        err = answers[0]
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details().startswith("backend 'triton-grpc'")
        assert ("was closed before it answered model 'slow_fp32': a config reload replaced it, or "
                "mmguard is stopping") in err.details()


def test_a_stop_cuts_what_a_retired_backend_was_still_draining(
        ort_models: Path, tmp_path: Path) -> None:
    """A stop while a retired backend waits for its calls (up to its bounds: minutes for a
    gRPC stream, a shadow copy's timeout) does not wait with it: the fronts have drained, so
    the retirement is cut and the backend closed at once, as a stop closes every backend. The
    drain is held open here by hand (the only part not real): no server keeps a call going
    on cue for nobody."""
    def config(threads: int) -> dict[str, Any]:
        cfg = ort_config(ort_models, shutdown_grace_s=0)
        cfg["backends"][0]["threads"] = threads
        return cfg

    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(config(1)))
    closes: list[bool] = []
    with RunningMmguard(config(1), config_path=path) as m:
        assert m.server is not None
        m.wait_ready(timeout=60)
        old = m.server.plane.runtime.backends["ort"]
        real_close = old.close

        async def held_close(drain: bool = False) -> None:
            closes.append(drain)
            if drain:
                await asyncio.Event().wait()  # a call that never ends, for nobody
            await real_close(drain)

        old.close = held_close  # type: ignore[method-assign]
        path.write_text(yaml.safe_dump(config(2)))  # the backend built anew, the old retired
        assert m.run(m.server.reload())
        deadline = time.monotonic() + 10
        while not closes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closes == [True], "the retired backend was not drained"
        started = time.monotonic()
        m.stop()
        assert time.monotonic() - started < 10, "the stop waited for the retired backend's drain"
    assert closes == [True, False], "the stop did not close the retired backend"
    assert old._closed  # type: ignore[attr-defined]


def test_a_call_that_reaches_its_backend_after_the_grace_is_served_by_the_runtime_it_took(
        ort_models: Path, tmp_path: Path) -> None:
    """A canary call held 2 s by an injected delay in the old runtime's chain reaches its
    backend 1.5 s after the reload's grace (0.5 s) is over: the retired runtime waits for its
    last call and closes its backend only then. Before, the call met a closed backend and was
    answered UNAVAILABLE ("a config reload replaced it"), a fault that changed more than the
    copy it touched."""
    def config(threads: int) -> dict[str, Any]:
        cfg = ort_config(ort_models, shutdown_grace_s=0.5,
                         canary={"headers": {"x-canary": "1"}},
                         listeners={"grpc": {"trust_canary_headers": True}})
        cfg["backends"][0]["threads"] = threads
        for route in cfg["models"]:
            if route["name"] == "identity_fp32":
                route["filters"] = [{"fault": {"experiments": [
                    {"name": "held", "actions": [{"kind": "delay", "ms": 2000}]}]}}]
        return cfg

    x = np.array([1.5, -2.0, 3.25], np.float32)
    body = grpc_request("identity_fp32", [("INPUT0", "FP32", [3], x.tobytes())])
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(config(1)))
    with RunningMmguard(config(1), config_path=path) as m:
        assert m.server is not None
        m.wait_ready(timeout=60)
        old = m.server.plane.runtime.backends["ort"]
        answers: list[Any] = []

        def call() -> None:
            try:
                answers.append(grpc_infer_raw(m.grpc_url, body, timeout=20,
                                              metadata=(("x-canary", "1"),)))
            except grpc.RpcError as exc:
                answers.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        _wait_in_flight(m, "identity_fp32")
        path.write_text(yaml.safe_dump(config(2)))  # the backend built anew, the old retired
        assert m.run(m.server.reload())
        assert m.server.plane.runtime.backends["ort"] is not old
        caller.join(30)
        assert len(answers) == 1
        answer = answers[0]
        assert not isinstance(answer, grpc.RpcError), (
            f"the call was refused by its retired runtime: {answer.code()} {answer.details()}")
        reply = pb.ModelInferResponse.FromString(answer[0])
        assert dict(answer[1]).get("mmguard-fault", "").startswith("held/delay")
        np.testing.assert_array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), x)
        deadline = time.monotonic() + 10  # and once it has ended, the old backend closes
        while not old._closed:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the retired backend stayed open"
            time.sleep(0.02)
