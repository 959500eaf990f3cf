"""The answer cache's key: keyed with a per-process secret, and covering the model, its version,
the parameters and every input byte — changing any one of them misses the cache."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable

import numpy as np
from blake3 import blake3

from filters.fallback import cache_key as module
from filters.fallback.cache_key import cache_key
from filters.fallback.filter import Fallback, FallbackConfig
from proxy.call import Call, LocalReply, Reply, RequestedOutput, Result, Target
from proxy.chain import FilterContext, compose
from proxy.clock import ManualClock
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor

PIXELS = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)


def v2_call() -> Call:
    image = Tensor.from_numpy("image", PIXELS.copy())
    image.parameters = {"layout": "nchw"}
    ids = Tensor.from_numpy("ids", np.array([[1, 2, 3]], np.int64))
    return Call(model="m", version="1", inputs=[image, ids], parameters={"priority": 1},
                outputs=[RequestedOutput("y", {"binary_data": True})], target=Target("b", "m"))


def openai_call(**changes: object) -> Call:
    doc: dict[str, object] = {"model": "llm", "messages": [{"role": "user", "content": "hi"}],
                              "temperature": 0.0, "max_tokens": 8}
    doc.update(changes)
    return Call(model="llm", version="", inputs=[], document=doc, target=Target("b", "llm"))


def with_byte_flipped(index: int) -> Call:
    c = v2_call()
    raw = bytearray(c.inputs[0].raw_bytes())
    raw[index] ^= 0x01
    c.inputs[0] = Tensor("image", "FP32", PIXELS.shape, raw=bytes(raw),
                         parameters={"layout": "nchw"})
    return c


def changed(edit: Callable[[Call], None]) -> Call:
    c = v2_call()
    edit(c)
    return c


def test_the_same_request_has_the_same_key() -> None:
    assert cache_key(v2_call()) == cache_key(v2_call())
    assert cache_key(openai_call()) == cache_key(openai_call())


def test_changing_any_one_input_byte_changes_the_key() -> None:
    base = cache_key(v2_call())
    size = PIXELS.nbytes
    keys = {cache_key(with_byte_flipped(i)) for i in range(size)}
    assert len(keys) == size  # every byte position gives its own key
    assert base not in keys


def test_every_byte_of_every_input_is_covered() -> None:
    """Not only the first input's: a byte of the second input, and the bytes of an input whose
    payload is a view into a larger buffer (a gRPC request's raw contents) — only the view's own
    bytes count, and each of them does."""
    base = cache_key(v2_call())
    ids_size = len(v2_call().inputs[1].raw_bytes())
    keys = set()
    for i in range(ids_size):
        c = v2_call()
        raw = bytearray(c.inputs[1].raw_bytes())
        raw[i] ^= 0x80
        c.inputs[1] = Tensor("ids", "INT64", (1, 3), raw=bytes(raw))
        keys.add(cache_key(c))
    assert len(keys) == ids_size and base not in keys

    body = b"\xff" * 16 + PIXELS.tobytes() + b"\xee" * 16  # the request around the tensor

    def viewed(buffer: bytes) -> Call:
        c = v2_call()
        c.inputs[0] = Tensor("image", "FP32", PIXELS.shape,
                             raw=memoryview(buffer)[16:16 + PIXELS.nbytes],
                             parameters={"layout": "nchw"})
        return c

    assert cache_key(viewed(body)) == base  # the bytes around the view are not part of it
    around = bytearray(body)
    around[0] ^= 1
    around[-1] ^= 1
    assert cache_key(viewed(bytes(around))) == base
    for i in (0, PIXELS.nbytes // 2, PIXELS.nbytes - 1):
        inside = bytearray(body)
        inside[16 + i] ^= 1
        assert cache_key(viewed(bytes(inside))) != base


def test_changing_the_model_version_parameters_names_or_shape_changes_the_key() -> None:
    def reshape(c: Call) -> None:  # the same bytes, another shape
        t = c.inputs[0]
        c.inputs[0] = Tensor(t.name, t.datatype, (1, 6, 4), raw=t.raw_bytes(),
                             parameters=t.parameters)

    def retype(c: Call) -> None:  # the same bytes read as INT32
        t = c.inputs[0]
        c.inputs[0] = Tensor(t.name, "INT32", t.shape, raw=t.raw_bytes(),
                             parameters=t.parameters)

    edits: dict[str, Callable[[Call], None]] = {
        "model": lambda c: setattr(c, "model", "m2"),
        "version": lambda c: setattr(c, "version", "2"),
        "request parameter value": lambda c: c.parameters.update(priority=2),
        "request parameter added": lambda c: c.parameters.update(sequence_id=7),
        "input parameter": lambda c: c.inputs[0].parameters.update(layout="nhwc"),
        "input name": lambda c: setattr(c.inputs[1], "name", "ids2"),
        "input dropped": lambda c: c.set_inputs(c.inputs[:1]),
        "input order": lambda c: c.inputs.reverse(),
        "requested output": lambda c: setattr(c.outputs[0], "name", "z"),
        "output parameter": lambda c: c.outputs[0].parameters.update(binary_data=False),
        "shape": reshape,
        "datatype": retype,
    }
    base = cache_key(v2_call())
    keys = {name: cache_key(changed(edit)) for name, edit in edits.items()}
    assert base not in keys.values()
    assert len(set(keys.values())) == len(edits), keys


def test_fields_cannot_run_into_each_other() -> None:
    a, b = v2_call(), v2_call()
    a.model, a.version = "ab", "c"
    b.model, b.version = "a", "bc"
    assert cache_key(a) != cache_key(b)


def test_an_openai_document_is_covered_except_its_transport_fields() -> None:
    base = cache_key(openai_call())
    assert cache_key(openai_call(temperature=0.5)) != base
    assert cache_key(openai_call(messages=[{"role": "user", "content": "hi!"}])) != base
    assert cache_key(openai_call(stream=True, stream_options={"include_usage": True},
                                 user="u1")) == base


def test_the_key_is_a_mac_under_a_per_process_secret() -> None:
    c = v2_call()
    assert len(module._SECRET) == 32
    assert cache_key(c, secret=bytes(32)) != cache_key(c)  # the secret is part of it
    assert cache_key(c, secret=bytes(32)) == cache_key(c, secret=bytes(32))
    unkeyed = blake3(b"".join(memoryview(t.raw_bytes()).tobytes() for t in c.inputs))
    assert cache_key(c) != unkeyed.hexdigest()
    # another process draws its own secret: the same request has another key there
    script = ("from tests.unit.test_fallback_cache_key import v2_call;"
              "from filters.fallback.cache_key import cache_key; print(cache_key(v2_call()))")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip()
    assert len(other) == 64 and other != cache_key(c)


async def test_the_cache_answers_only_the_identical_request() -> None:
    healthy = [True]

    async def terminal(c: Call) -> Reply:
        if not healthy[0]:
            return LocalReply(ErrorKind.UNAVAILABLE, "backend down")
        return Result("m", "1", "", [Tensor.from_numpy("y", PIXELS * 2)])

    ctx = FilterContext("m", Telemetry(), ManualClock(), random.Random(1), lambda: None)
    fallback = Fallback(FallbackConfig.model_validate({"breaker": {"minimum_calls": 100}}), ctx)
    run = compose([("fallback", fallback)], terminal)
    first = await run(v2_call())
    assert isinstance(first, Result)
    healthy[0] = False
    same = v2_call()
    answer = await run(same)
    assert isinstance(answer, Result) and same.decisions.get("mmguard-stale") == "true"
    np.testing.assert_array_equal(answer.outputs[0].numpy(), PIXELS * 2)
    for other in (with_byte_flipped(PIXELS.nbytes - 1), changed(lambda c: c.parameters.clear())):
        missed = await run(other)
        assert isinstance(missed, LocalReply) and missed.kind is ErrorKind.UNAVAILABLE
        assert "no level could answer" in missed.message


async def test_a_cached_answer_never_changes_with_the_buffer_it_came_in() -> None:
    """The cache keeps a view into an immutable body (a decoded answer's ``bytes``) without a
    copy, and copies anything else: a shared-memory region or a reused buffer that is written
    again after the call does not change the answer served from the cache."""
    body = (PIXELS * 2).tobytes()
    for label in ("bytes body", "reused buffer"):
        reused = bytearray(body)
        raw = memoryview(body) if label == "bytes body" else memoryview(reused)
        healthy = [True]

        async def terminal(c: Call, raw: memoryview = raw,
                           healthy: list[bool] = healthy) -> Reply:
            if not healthy[0]:
                return LocalReply(ErrorKind.UNAVAILABLE, "backend down")
            return Result("m", "1", "", [Tensor("y", "FP32", PIXELS.shape, raw=raw)])

        ctx = FilterContext("m", Telemetry(), ManualClock(), random.Random(1), lambda: None)
        fallback = Fallback(FallbackConfig(), ctx)
        run = compose([("fallback", fallback)], terminal)
        assert isinstance(await run(v2_call()), Result)
        reused[:] = bytes(len(reused))  # the buffer is written again by the next request
        healthy[0] = False
        answer = await run(v2_call())
        assert isinstance(answer, Result), label
        np.testing.assert_array_equal(answer.outputs[0].numpy(), PIXELS * 2, err_msg=label)
        kept = answer.outputs[0].raw
        if label == "bytes body":  # not copied: the view over the immutable body itself
            assert isinstance(kept, memoryview) and kept.obj is body
