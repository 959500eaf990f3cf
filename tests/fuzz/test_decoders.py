"""The wire decoders, fuzzed in-process: any input gives a value or a 4xx ``ProxyError`` with a
message, never another exception, within the profile's deadline (see ``tests/fuzz/oracle.py``
for the property, ``profiles.py`` for the example counts)."""

from __future__ import annotations

from typing import Any

from hypothesis import given

from tests.fuzz.profiles import FUZZ
from tests.fuzz.properties import (
    DECODERS,
    check_bytes_framing,
    check_config,
    check_grpc,
    check_grpc_answer,
    check_http,
    check_image,
    check_openai,
    check_pbwire,
)


@FUZZ
@given(DECODERS["pbwire"].inputs())
def test_pbwire_field_walk(body: bytes) -> None:
    check_pbwire(body)


@FUZZ
@given(DECODERS["bytes_framing"].inputs())
def test_bytes_element_framing(case: tuple[bytes, int]) -> None:
    check_bytes_framing(case)


@FUZZ
@given(DECODERS["grpc_v2"].inputs())
def test_grpc_model_infer_request(body: bytes) -> None:
    check_grpc(body)


@FUZZ
@given(DECODERS["grpc_v2_answer"].inputs())
def test_grpc_model_infer_response(body: bytes) -> None:
    check_grpc_answer(body)


@FUZZ
@given(DECODERS["http_v2"].inputs())
def test_http_v2_json_and_binary_bodies(case: tuple[bytes, str | None]) -> None:
    check_http(case)


@FUZZ
@given(DECODERS["openai"].inputs())
def test_openai_chat_and_completions(case: tuple[bytes, str]) -> None:
    check_openai(case)


@FUZZ
@given(DECODERS["data_url"].inputs())
def test_data_url_images(url: str) -> None:
    check_image(url)


@FUZZ
@given(DECODERS["config"].inputs())
def test_parse_config(doc: Any) -> None:
    check_config(doc)
