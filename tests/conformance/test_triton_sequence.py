"""Sequence models and decoupled streams over ``ModelStreamInfer``: the same client code direct
and through mmguard. Before the fix each message of a stream became its own task and backend
call, so the requests of one sequence reached Triton out of order ("must specify the START flag
on the first request", or wrong running sums)."""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conformance.conftest import Target

SEQUENCES = 16
STEPS = 6
MODEL = "sequence_accumulate"


def _value(seq: int, step: int) -> int:
    return seq * 100 + step + 1


def _expected(seq: int, step: int) -> int:
    return sum(_value(seq, s) for s in range(step + 1))


def _grpc_input(value: int) -> grpcclient.InferInput:
    t = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return t


class _Stream:
    """A tritonclient gRPC stream whose results land in a queue."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def take(self, count: int, timeout: float = 60) -> list[tuple[Any, Any]]:
        return [self.results.get(timeout=timeout) for _ in range(count)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_sixteen_sequences_interleaved_on_one_stream(stream_target: Target) -> None:
    """16 sequences, their requests interleaved round-robin on one stream and sent without
    waiting: every running sum is right, so every request reached Triton in the order sent."""
    stream = _Stream(stream_target.grpc_url)
    base = 1000
    try:
        for step in range(STEPS):
            for seq in range(SEQUENCES):
                stream.client.async_stream_infer(
                    MODEL, [_grpc_input(_value(seq, step))], request_id=f"{seq}/{step}",
                    sequence_id=base + seq, sequence_start=step == 0,
                    sequence_end=step == STEPS - 1)
        got = stream.take(SEQUENCES * STEPS)
    finally:
        stream.close()
    errors = [str(e) for _, e in got if e is not None]
    assert not errors, errors[:3]
    sums = {}
    for result, _ in got:
        seq, step = (int(x) for x in result.get_response().id.split("/"))
        sums[(seq, step)] = int(result.as_numpy("OUTPUT").reshape(-1)[0])
    assert sums == {(q, s): _expected(q, s) for q in range(SEQUENCES) for s in range(STEPS)}


def test_sixteen_concurrent_streams(stream_target: Target) -> None:
    """16 clients at once, one sequence each, each sending all its requests without waiting."""
    failures: list[str] = []

    def run(seq: int) -> None:
        stream = _Stream(stream_target.grpc_url)
        try:
            for step in range(STEPS):
                stream.client.async_stream_infer(
                    MODEL, [_grpc_input(_value(seq, step))], sequence_id=2000 + seq,
                    sequence_start=step == 0, sequence_end=step == STEPS - 1)
            values = []
            for result, error in stream.take(STEPS):
                if error is not None:
                    failures.append(f"sequence {seq}: {error}")
                    return
                values.append(int(result.as_numpy("OUTPUT").reshape(-1)[0]))
            if values != [_expected(seq, s) for s in range(STEPS)]:
                failures.append(f"sequence {seq}: {values}")
        finally:
            stream.close()

    threads = [threading.Thread(target=run, args=(q,)) for q in range(SEQUENCES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]


def test_request_without_start_is_refused_by_triton(stream_target: Target) -> None:
    stream = _Stream(stream_target.grpc_url)
    try:
        stream.client.async_stream_infer(MODEL, [_grpc_input(1)], sequence_id=987654,
                                         sequence_start=False)
        (_, error), = stream.take(1)
    finally:
        stream.close()
    assert error is not None and "START" in str(error)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unary_sequences_over_both_fronts(target: Target, protocol: str) -> None:
    """Sequence parameters (id, start, end) cross both fronts and both backends: 16 sequences
    at once, each a client sending its requests one after another."""
    failures: list[str] = []

    def run(seq: int) -> None:
        sid = 3000 + seq + (0 if protocol == "grpc" else 100)
        if protocol == "grpc":
            client: Any = grpcclient.InferenceServerClient(target.grpc_url)
            make = _grpc_input
        else:
            client = httpclient.InferenceServerClient(target.http_url)

            def make(value: int) -> Any:
                t = httpclient.InferInput("INPUT", [1, 1], "INT32")
                t.set_data_from_numpy(np.array([[value]], dtype=np.int32))
                return t
        try:
            for step in range(STEPS):
                result = client.infer(MODEL, [make(_value(seq, step))], sequence_id=sid,
                                      sequence_start=step == 0, sequence_end=step == STEPS - 1)
                got = int(result.as_numpy("OUTPUT").reshape(-1)[0])
                if got != _expected(seq, step):
                    failures.append(f"sequence {seq} step {step}: {got}")
        except InferenceServerException as exc:
            failures.append(f"sequence {seq}: {exc}")
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(q,)) for q in range(SEQUENCES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]


def test_decoupled_stream_several_requests(stream_target: Target) -> None:
    """A decoupled model answers each request of a stream with ``count`` responses and a final
    flag; every value arrives, in order within each request, and no request is lost."""
    stream = _Stream(stream_target.grpc_url)
    counts = {"a": 3, "b": 0, "c": 5}
    try:
        for rid, count in counts.items():
            t = grpcclient.InferInput("count", [1], "INT32")
            t.set_data_from_numpy(np.array([count], dtype=np.int32))
            stream.client.async_stream_infer("decoupled_counter", [t], request_id=rid,
                                             enable_empty_final_response=True)
        got = stream.take(sum(counts.values()) + len(counts))
    finally:
        stream.close()
    values: dict[str, list[int]] = {rid: [] for rid in counts}
    finals = []
    for result, error in got:
        assert error is None, error
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param:
            finals.append(response.id)
            continue
        values[response.id].append(int(result.as_numpy("value")[0]))
    assert sorted(finals) == sorted(counts)
    assert values == {rid: list(range(n)) for rid, n in counts.items()}


def test_decoupled_error_keeps_stream_open(stream_target: Target) -> None:
    stream = _Stream(stream_target.grpc_url)
    try:
        for count in (-1, 2):
            t = grpcclient.InferInput("count", [1], "INT32")
            t.set_data_from_numpy(np.array([count], dtype=np.int32))
            stream.client.async_stream_infer("decoupled_counter", [t])
        got = stream.take(3)
    finally:
        stream.close()
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "count must be >= 0" in str(errors[0])
    assert sorted(int(r.as_numpy("value")[0]) for r, e in got if e is None) == [0, 1]
