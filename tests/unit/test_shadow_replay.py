"""What a client sends cannot steer the shadow's verdict: a replay counts once, a failure the
client caused is not judged, and treatment headers reach only listeners that show them."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from filters.shadow.filter import SHADOWS
from filters.shadow.replay import RecentKeys, client_caused, content_key
from proxy.call import SHOW_TREATMENT, TREATMENT, Call, LocalReply, Result, Target
from proxy.errors import ErrorKind
from proxy.telemetry import Telemetry
from proxy.tensor import Tensor
from tests.support.chain_harness import ChainHarness, x

SECRET = b"the deployment's secret"
SHADOWED = {"models": [{"name": "prod", "filters": [{"shadow": {"canary": "cand",
                                                                "percent": 100}}]},
                       {"name": "cand"}]}


def _call(value: float = 1.0, request_id: str = "", json_form: bool = False) -> Call:
    t = x(value=value)
    if json_form:
        t = Tensor(t.name, t.datatype, t.shape, data=t.numpy().reshape(-1).tolist())
    return Call("prod", "", [t], id=request_id, headers={"x-request-id": request_id})


def test_the_key_is_the_content_not_the_id_nor_the_encoding() -> None:
    one = content_key(_call(1.0, "a"), SECRET)
    assert content_key(_call(1.0, "b"), SECRET) == one  # a new id is the same request
    assert content_key(_call(1.0, "c", json_form=True), SECRET) == one  # JSON or binary
    assert content_key(_call(2.0, "a"), SECRET) != one  # another input is another request
    assert content_key(_call(1.0, "a"), b"another deployment") != one  # keyed


def test_an_openai_body_is_keyed_without_its_ids() -> None:
    def chat(**extra: object) -> Call:
        doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        return Call("m", "", [], document=doc, endpoint="/v1/chat/completions")
    base = content_key(chat(), SECRET)
    assert content_key(chat(user="u1", metadata={"k": "v"}, stream=True), SECRET) == base
    assert content_key(chat(max_tokens=3), SECRET) != base  # changes what is answered


def test_recent_keys_are_bounded_and_forget_the_oldest() -> None:
    keys = RecentKeys(3)
    assert all(keys.add(k) for k in (1, 2, 3))
    assert not keys.add(2) and len(keys) == 3
    assert keys.add(4) and len(keys) == 3  # 1 forgotten
    assert keys.add(1)


def test_failures_the_client_caused_are_named() -> None:
    call = _call()
    call.deadline = call.started + 0.001  # mmguard-timeout-ms: 1
    late = LocalReply(ErrorKind.DEADLINE_EXCEEDED, "deadline passed")
    assert client_caused(call, late, copy_timeout_s=10) == "deadline"
    call.deadline = call.started + 30  # production had longer than the copy: evidence
    assert client_caused(call, late, copy_timeout_s=10) is None
    for kind, why in ((ErrorKind.CANCELLED, "cancelled"), (ErrorKind.OVERLOADED, "overload"),
                      (ErrorKind.INVALID_ARGUMENT, "input-refused")):
        assert client_caused(call, LocalReply(kind, "x"), 10) == why
    assert client_caused(call, LocalReply(ErrorKind.UNAVAILABLE, "down"), 10) is None
    backend_cancelled = LocalReply(ErrorKind.CANCELLED, "cancelled", origin="backend")
    assert client_caused(call, backend_cancelled, 10) is None  # the backend dropped it
    assert client_caused(call, Result("prod"), 10) is None
    injected = LocalReply(ErrorKind.CANCELLED, "x", injected="e/abort")
    assert client_caused(call, injected, 10) is None  # a fault: excluded where it is judged


async def _settle(h: ChainHarness, asked: int) -> None:
    for _ in range(2000):
        if sum(1 for c in h.backend.calls if c.target and c.target.model == "cand") >= asked:
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)


async def test_a_replayed_request_is_judged_once_and_sent_to_the_canary_once() -> None:
    def wrong_canary(call: Call, target: Target) -> Result:
        arr = call.inputs[0].numpy()
        out = arr if target.model == "prod" or float(arr.flat[0]) < 0.5 else -arr
        return Result(target.model, outputs=[Tensor.from_numpy("x", np.ascontiguousarray(out))])

    async with ChainHarness.open(SHADOWED, answer=wrong_canary) as h:
        for i in range(5):  # honest traffic: the canary is wrong on every one of these
            await h.infer("prod", [x(value=1.0 + i)], request_id=f"honest-{i}")
        for i in range(50):  # one easy request, replayed under fresh ids
            await h.infer("prod", [x(value=0.1)], request_id=f"replay-{i}")
        await _settle(h, 6)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        assert shadow.queue is not None
        await asyncio.wait_for(shadow.queue.join(), 30)  # every replay seen, however busy
        snap = shadow.snapshot()
    assert snap["compared"] == 6, snap
    assert snap["unjudged"] == {"replay": 49}, snap
    assert sum(1 for c in h.backend.calls if c.target and c.target.model == "cand") == 6
    assert shadow.state.verdict.snapshot()["agreement"] == 1 / 6


async def test_a_reset_opens_a_new_window_for_every_key() -> None:
    async with ChainHarness.open(SHADOWED) as h:
        await h.infer("prod", [x(value=3.0)])
        await _settle(h, 1)
        shadow = (h.runtime.local.get(SHADOWS) or {})["prod"]
        shadow.reset()
        await h.infer("prod", [x(value=3.0)])
        await _settle(h, 2)
    assert shadow.state.compared == 2 and not shadow.state.unjudged


def test_treatment_headers_leave_only_for_a_listener_that_shows_them() -> None:
    call = Call("m", "", [])
    t = Telemetry()
    t.decide(call, "shadow", "mirrored", "to 'cand'", treatment=True)
    t.decide(call, "shape", "reject", "too long", header="context")
    assert set(call.decisions) == {"mmguard-shadow", "mmguard-shape-context"}
    assert call.state.get(TREATMENT) == {"mmguard-shadow"}
    assert set(call.shown_decisions()) == {"mmguard-shape-context"}  # untrusted: hidden
    call.state[SHOW_TREATMENT] = True
    assert set(call.shown_decisions()) == {"mmguard-shadow", "mmguard-shape-context"}


def test_a_deadline_budget_is_measured_from_the_calls_start() -> None:
    call = _call()
    call.started = time.monotonic() - 5  # an old call with a long deadline still had 5 s+
    call.deadline = call.started + 20
    assert client_caused(call, LocalReply(ErrorKind.DEADLINE_EXCEEDED, "late"), 10) is None
