"""A level's copy of a call (``filters.fallback.clone.clone_call``) is what
``dataclasses.replace`` would make: every field of ``Call`` carried over, the target, the input
list and the document its own — so a field added to ``Call`` later cannot be dropped silently."""

from __future__ import annotations

import dataclasses
from typing import Any

from filters.fallback.clone import clone_call
from proxy.call import Call, RequestedOutput, Target, Wire
from proxy.keys import Store
from proxy.tensor import Tensor


def _call(document: dict[str, Any] | None) -> Call:
    state = Store()
    call = Call(model="m", version="3", inputs=[Tensor("x", "FP32", (1,), raw=b"\0\0\x80?")],
                id="req-1", outputs=[RequestedOutput("y", {"binary_data": True})],
                parameters={"priority": 2}, headers={"x-a": "1"}, front="grpc",
                streaming=True, deadline=123.5, wire=Wire("grpc", b"body"), document=document,
                endpoint="/v1/chat/completions", target=Target("b", "m-backend", "7"),
                state=state, decisions={"mmguard-x": "y"}, started=99.25)
    return call


def _fields(call: Call) -> dict[str, Any]:
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(Call)}


def test_every_field_is_carried_over() -> None:
    defaults = _fields(Call("", "", []))
    for document in (None, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}):
        call = _call(document)
        # every field differs from its default, so a field the copy forgot would show
        assert all(v != defaults[k] for k, v in _fields(call).items()
                   if not (k == "document" and document is None)), _fields(call)
        copy = clone_call(call)
        assert call.target is not None
        expected = dataclasses.replace(call, target=dataclasses.replace(call.target),
                                       inputs=list(call.inputs), document=document)
        assert _fields(copy) == _fields(expected)


def test_the_copy_owns_its_target_inputs_and_document() -> None:
    document = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    call = _call(document)
    copy = clone_call(call)
    assert copy is not call
    assert copy.target is not call.target and copy.target == call.target
    assert copy.inputs is not call.inputs and copy.inputs == call.inputs
    assert copy.document is not call.document and copy.document == call.document
    copy.inputs.append(Tensor("z", "FP32", (1,), raw=b"\0\0\0\0"))
    assert copy.target is not None and call.target is not None
    copy.target.model = "other"
    assert copy.document is not None and call.document is not None
    copy.document["messages"][0]["content"] = "changed"
    assert [t.name for t in call.inputs] == ["x"]
    assert call.target.model == "m-backend"
    assert call.document["messages"][0]["content"] == "hi"
    # per-request state and decisions stay the call's, whichever copy records them
    assert copy.state is call.state and copy.decisions is call.decisions
