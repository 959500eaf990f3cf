"""Malformed requests over real sockets to all three fronts of one running mmguard: each answer
is a success or a 4xx / client-error gRPC code with a message, never a 5xx or a hang, and the
proxy still answers a valid request correctly afterwards."""

from __future__ import annotations

from typing import Any

from hypothesis import given

from tests.fuzz.fronts import FRONTS, Client, check_still_serving
from tests.fuzz.profiles import FRONTS as FRONT_SETTINGS


@FRONT_SETTINGS
@given(FRONTS["front_http_v2"].inputs())
def test_http_v2_front(fuzz_client: Client, case: Any) -> None:
    FRONTS["front_http_v2"].check(fuzz_client, case)


@FRONT_SETTINGS
@given(FRONTS["front_openai"].inputs())
def test_openai_front(fuzz_client: Client, case: Any) -> None:
    FRONTS["front_openai"].check(fuzz_client, case)


@FRONT_SETTINGS
@given(FRONTS["front_grpc"].inputs())
def test_grpc_front(fuzz_client: Client, body: bytes) -> None:
    FRONTS["front_grpc"].check(fuzz_client, body)


def test_still_serving_after_the_fuzzing(fuzz_client: Client) -> None:
    check_still_serving(fuzz_client)
