"""``proxy.wire.openai.streaming`` reads ``stream`` as vLLM's request model does: pydantic's lax
bool (the same pydantic vLLM validates with), every value it refuses read as not streaming (the
request goes on and vLLM refuses it in its own words)."""

from __future__ import annotations

import json

import pydantic
import pytest

from proxy.errors import ProxyError
from proxy.wire.openai import parse_request, streaming

VALUES: list[object] = [
    True, False, None, 0, 1, 2, -1, 0.0, 1.0, 0.5, "0", "1", "f", "t", "n", "y", "no", "yes",
    "off", "on", "false", "true", "FALSE", "True", "YeS", "oFf", " true", "true ", "", "2",
    "maybe", "tru", [], {}, [True]]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_stream_is_read_as_pydantic_reads_it(value: object) -> None:
    try:
        theirs = bool(pydantic.TypeAdapter(bool | None).validate_python(value))
    except pydantic.ValidationError:
        theirs = False  # refused by vLLM: not streamed by mmguard
    assert streaming(value) is theirs


def test_the_call_takes_it() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "false"}'
    assert parse_request(body, "chat").streaming is False
    assert parse_request(body.replace(b'"false"', b'"on"'), "chat").streaming is True


PROMPTS: list[object] = [
    "a", ["a", "b"], [1, 2], [[1], [2, 3]], [True, 2.0, "3"], [[False]], [], [[]], [1.5],
    ["a", 1], [None], 5, None, {"a": 1}, [[1], "a"], ["１"], [" 7 "], [1e20]]


@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_a_prompt_is_refused_only_where_vllms_model_refuses_it(prompt: object) -> None:
    """vLLM's own type for ``prompt`` (its token ids are non-negative ints, read lax)."""
    vllm_type = pydantic.TypeAdapter(list[int] | list[list[int]] | str | list[str] | None)
    try:
        vllm_type.validate_python(prompt)
        served = prompt is not None  # vLLM's model takes null; then it asks for a prompt
    except pydantic.ValidationError:
        served = False
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    try:
        parse_request(body, "/v1/completions")
        ours = True
    except ProxyError as err:
        assert "prompt" in str(err)
        ours = False
    assert ours is served
