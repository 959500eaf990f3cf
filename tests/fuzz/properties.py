"""One check per wire decoder, given one drawn input; the registry ``DECODERS`` pairs each with
the strategy that feeds it. ``test_decoders.py`` runs them under ``@FUZZ``; ``fuzz_long.py``
runs them for minutes. A check returns when the decoder behaved and raises otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from hypothesis import strategies as st

from proxy.call import Call, Result
from proxy.config.model import Config, ConfigError, parse_config
from proxy.errors import ProxyError
from proxy.tensor import Tensor, decode_bytes_elements, encode_bytes_elements
from proxy.wire import kserve_grpc, kserve_http, openai, pbwire
from tests.fuzz.config_inputs import config_docs
from tests.fuzz.openai_inputs import ALLOWED_HOSTS, data_urls, openai_bodies
from tests.fuzz.oracle import check_call_usable, decodes_or_refuses
from tests.fuzz.v2_inputs import bytes_payloads, grpc_answers, grpc_bodies, http_bodies

T = TypeVar("T")


def check_pbwire(body: bytes) -> None:
    """The field walk covers the body exactly, or refuses it with a WireError that says where."""
    try:
        spans = list(pbwire.fields(memoryview(body)))
    except pbwire.WireError as err:
        assert str(err).strip()
        return
    pos = 0
    for _, start, value, end in spans:
        assert start == pos and start < value <= end, (start, value, end, pos)
        pos = end
    assert pos == len(body)


def check_bytes_framing(case: tuple[bytes, int]) -> None:
    """Length-prefixed BYTES elements split back into what was framed, or a refusal."""
    raw, count = case
    items = decodes_or_refuses(decode_bytes_elements, raw, count, "x")
    if items is not None:
        assert len(items) == count and encode_bytes_elements(items) == raw


def _reencodes(call: Call) -> None:
    """An accepted call can be sent on to a backend of either protocol once edited."""
    call.wire = None
    kserve_grpc.encode_request(call, call.model, call.version)
    kserve_http.encode_request(call)


def check_grpc(body: bytes) -> None:
    call = decodes_or_refuses(kserve_grpc.decode_request, body)
    assert grpc_outcome(kserve_grpc.decode_request, body) == walk_only(
        grpc_outcome, kserve_grpc.decode_request, body), "the whole parse and the walk differ"
    if call is not None:
        check_call_usable(call)
        _reencodes(call)


def check_grpc_answer(body: bytes) -> None:
    """A backend's ModelInferResponse: a checked ``Result`` or a BAD_GATEWAY refusal, the same
    whether the small answer is parsed whole or walked."""
    assert grpc_outcome(kserve_grpc.decode_response, body) == walk_only(
        grpc_outcome, kserve_grpc.decode_response, body), "the whole parse and the walk differ"


def walk_only(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``kserve_grpc``'s whole parse of small messages off: the walk alone."""
    saved = kserve_grpc.WHOLE_PARSE_BYTES
    kserve_grpc.WHOLE_PARSE_BYTES = -1
    try:
        return fn(*args)
    finally:
        kserve_grpc.WHOLE_PARSE_BYTES = saved


def _tensor_view(t: Tensor) -> tuple[Any, ...]:
    return (t.name, t.datatype, t.shape, repr(t.parameters),
            None if t.raw is None else (type(t.raw).__name__, bytes(t.raw)))


def grpc_outcome(decode: Callable[[bytes], Call | Result], body: bytes) -> tuple[Any, ...]:
    """What a gRPC decoder made of ``body``, comparable across its two parses: its refusal
    (kind and text), or every field of the call or answer it built."""
    try:
        got = decode(body)
    except ProxyError as err:
        return ("refused", err.kind, err.message)
    if isinstance(got, Call):
        return ("call", got.model, got.version, got.id, repr(got.parameters),
                [(o.name, repr(o.parameters)) for o in got.outputs],
                [_tensor_view(t) for t in got.inputs], got.wire)
    return ("answer", got.model, got.version, got.id, repr(got.parameters),
            [_tensor_view(t) for t in got.outputs], got.wire)


def check_http(case: tuple[bytes, str | None]) -> None:
    body, header_length = case
    call = decodes_or_refuses(kserve_http.decode_request, body, header_length, "m", "",
                              kserve_http.JSON_TYPE)
    if call is not None:
        check_call_usable(call)
        _reencodes(call)


def check_openai(case: tuple[bytes, str]) -> None:
    body, endpoint = case
    call = decodes_or_refuses(openai.decode_request, body, endpoint, ALLOWED_HOSTS)
    if call is None:
        return
    # What the filters read next (quality, shape_guard, the modality router): typed views.
    view = openai.ChatView(call)
    texts = decodes_or_refuses(view.texts)
    assert texts is None or all(isinstance(t, str) for t in texts), texts
    decodes_or_refuses(view.images)
    assert view.max_tokens is None or isinstance(view.max_tokens, int)
    openai.encode_request(call, "backend-model")


def check_image(url: str) -> None:
    part = openai.ImagePart(0, 0, url)
    rgb = decodes_or_refuses(part.array)
    if rgb is not None:
        assert rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8, rgb.shape


_CONFIG_KEYS = frozenset(Config.model_fields)


def check_config(doc: Any) -> None:
    """A Config, or a ConfigError whose every problem starts with the key path it is about."""
    try:
        parse_config(doc)
    except ConfigError as err:
        assert err.problems
        if doc is None:
            assert err.problems == ["the file is empty"]
            return
        heads = _CONFIG_KEYS | (set(doc) if isinstance(doc, dict) else set())
        for problem in err.problems:
            assert isinstance(problem, str) and ": " in problem, problem
            assert problem.startswith("(top level): ") or any(
                problem.startswith(k) and problem[len(k):len(k) + 1] in (".", "[", ":")
                for k in heads if isinstance(k, str) and k), problem


@dataclass(frozen=True)
class Decoder:
    name: str
    inputs: Callable[[], st.SearchStrategy[Any]]
    check: Callable[[Any], None]


DECODERS = {d.name: d for d in [
    Decoder("pbwire", lambda: st.binary(max_size=256) | grpc_bodies(), check_pbwire),
    Decoder("bytes_framing", bytes_payloads, check_bytes_framing),
    Decoder("grpc_v2", grpc_bodies, check_grpc),
    Decoder("grpc_v2_answer", grpc_answers, check_grpc_answer),
    Decoder("http_v2", http_bodies, check_http),
    Decoder("openai", openai_bodies, check_openai),
    Decoder("data_url", data_urls, check_image),
    Decoder("config", config_docs, check_config),
]}
