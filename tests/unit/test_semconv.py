"""Every span attribute mmguard writes is current in the installed semantic-conventions
package: a key the package marks deprecated (``rpc.system``, ``rpc.service``,
``rpc.grpc.status_code``, ``gen_ai.system``...) fails here, with the package's own note."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import grpc
import pytest
from opentelemetry import semconv

from proxy.call import Call
from proxy.telemetry import end_server_span, gen_ai_usage, server_span
from proxy.telemetry.tracing import _client_span

_MOVED = "Moved to the [OpenTelemetry GenAI semantic conventions repository]"
"""gen_ai.* moved to its own repository: current there, not replaced (not a deprecation)."""


def _semconv_keys() -> dict[str, str]:
    """Every attribute key the package defines → its deprecation note ("" when current), read
    from the docstring under each constant (the package's only record of it)."""
    root = pathlib.Path(semconv.__file__).parent
    notes: dict[str, str] = {}
    for path in [*root.glob("attributes/*.py"), *root.glob("_incubating/attributes/*.py")]:
        body: list[ast.stmt | None] = list(ast.parse(path.read_text()).body)
        for node, after in zip(body, [*body[1:], None][:len(body)], strict=True):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                continue
            doc = (after.value.value if isinstance(after, ast.Expr)
                   and isinstance(after.value, ast.Constant) else "")
            doc = doc.strip() if isinstance(doc, str) else ""
            note = doc if doc.startswith("Deprecated:") and _MOVED not in doc else ""
            notes.setdefault(node.value.value, note)
    return notes


class _Recorder:
    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def is_recording(self) -> bool:
        return True


def _call(front: str, streaming: bool = False, endpoint: str = "") -> Call:
    return Call("m", "", [], front=front, streaming=streaming, endpoint=endpoint)


def _emitted() -> list[tuple[str, str, Any]]:
    """(where, key, value) for every attribute mmguard's spans can carry."""
    out: list[tuple[str, str, Any]] = []
    calls = [_call("grpc"), _call("grpc", streaming=True), _call("http"),
             *(_call("openai", endpoint=e) for e in ("/v1/chat/completions", "/v1/completions",
                                                      "/v1/embeddings", "/v1/responses"))]
    for call in calls:
        _, attrs = server_span(call, "https")
        rec = _Recorder()
        end_server_span(rec, call, "unavailable", 503, grpc.StatusCode.UNAVAILABLE)
        out += [(f"server {call.front}", k, v) for k, v in {**attrs, **rec.attributes}.items()]
    for protocol, address in (("grpc", "127.0.0.1:8001"), ("http", "http://127.0.0.1:8000"),
                              ("openai", "http://127.0.0.1:8100"), ("onnxruntime", "")):
        for call in calls:
            _, attrs = _client_span(call, protocol, "b", "m", address)
            out += [(f"client {protocol}", k, v) for k, v in attrs.items()]
    rec = _Recorder()
    gen_ai_usage(rec, {"model": "m", "usage": {"prompt_tokens": 1, "completion_tokens": 2},
                       "choices": [{"finish_reason": "stop"}]})
    out += [("gen_ai usage", k, v) for k, v in rec.attributes.items()]
    return out


def test_no_span_attribute_is_deprecated() -> None:
    notes = _semconv_keys()
    assert notes["rpc.system"].startswith("Deprecated:")  # the check itself can see one
    bad = {(where, key, notes[key]) for where, key, _ in _emitted()
           if not key.startswith("mmguard.") and notes.get(key)}
    assert not bad, bad


def test_every_non_mmguard_key_is_one_the_package_defines() -> None:
    notes = _semconv_keys()
    unknown = {(where, key) for where, key, _ in _emitted()
               if not key.startswith("mmguard.") and key not in notes}
    assert not unknown, unknown


@pytest.mark.parametrize("streaming", [False, True])
def test_rpc_method_is_fully_qualified_and_status_a_name(streaming: bool) -> None:
    call = _call("grpc", streaming=streaming)
    name, attrs = server_span(call)
    assert attrs["rpc.method"] == name == ("inference.GRPCInferenceService/"
                                           + ("ModelStreamInfer" if streaming else "ModelInfer"))
    rec = _Recorder()
    end_server_span(rec, call, None, 200, grpc.StatusCode.OK)
    assert rec.attributes == {"rpc.response.status_code": "OK"}


def test_server_spans_carry_the_scheme_and_client_spans_the_full_url() -> None:
    _, attrs = server_span(_call("http"), "https")
    assert attrs["url.scheme"] == "https"
    _, attrs = _client_span(_call("openai", endpoint="/v1/embeddings"), "openai", "b", "m",
                            "http://10.0.0.5:8100")
    assert attrs["url.full"] == "http://10.0.0.5:8100/v1/embeddings"
    assert attrs["gen_ai.operation.name"] == "embeddings"  # not "chat"
    assert attrs["gen_ai.provider.name"] == "openai"
