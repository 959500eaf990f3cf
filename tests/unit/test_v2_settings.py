"""The v2 fronts' settings and body inflation: what a config must say before the repository
API opens, and how a compressed body is inflated (once, bounded, refused with a reason)."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from proxy.config.model import ConfigError, parse_config
from proxy.errors import ErrorKind, ProxyError
from proxy.fronts.body import INLINE_INFLATE_BYTES, inflate
from proxy.fronts.http_v2 import answer_coding

TRITON = {"kind": "triton_grpc", "name": "t", "url": "127.0.0.1:8001"}
MODELS = [{"name": "m", "backend": "t"}]


def _config(**extra: object) -> dict[str, object]:
    return {"backends": [TRITON], "models": MODELS, **extra}


@pytest.mark.parametrize(("doc", "message"), [
    (_config(v2={"repository_api": True}), "v2.repository_api needs the admin token"),
    (_config(v2={"backend": "nope"}), "v2.backend 'nope' is not a Triton backend"),
    ({"backends": [TRITON, {**TRITON, "name": "u"}], "models": MODELS,
      "v2": {"repository_api": True}, "listeners": {"admin": {"token": "x"}}},
     "set v2.backend"),
    (_config(v2={"server_metadata": "triton"}), "v2.server_metadata"),
    (_config(listeners={"http": {"max_json_bytes": 0}}), "listeners.http.max_json_bytes"),
])
def test_bad_v2_settings_are_refused_at_load(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert message in str(err.value)


def test_repository_api_with_a_token_loads() -> None:
    cfg = parse_config(_config(v2={"repository_api": True},
                               listeners={"admin": {"token": "secret-token"}}))
    assert cfg.v2.repository_api and cfg.v2_backend() == "t"
    assert "secret-token" not in repr(cfg)


def _inflate(raw: bytes, coding: str, limit: int) -> bytes:
    return asyncio.run(inflate(raw, coding, limit, "the.setting"))


@pytest.mark.parametrize("size", [0, 10, INLINE_INFLATE_BYTES + 12345])
def test_inflate_gzip_zlib_and_raw_deflate(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    raw_deflate = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    assert _inflate(gzip.compress(data), "gzip", size + 1) == data
    assert _inflate(zlib.compress(data), "deflate", size + 1) == data
    assert _inflate(raw_deflate.compress(data) + raw_deflate.flush(), "deflate", size + 1) == data


def test_inflate_stops_at_the_limit() -> None:
    bomb = gzip.compress(bytes(64 * 1024 * 1024))
    with pytest.raises(ProxyError) as err:
        _inflate(bomb, "gzip", 1024 * 1024)
    assert err.value.kind is ErrorKind.TOO_LARGE
    assert "inflates past 1048576 bytes" in err.value.message
    assert "the.setting" in err.value.message


@pytest.mark.parametrize(("raw", "why"), [
    (b"not gzip at all", "not valid gzip"),
    (gzip.compress(b"a" * 1000)[:-12], "ends before the compressed stream does"),
])
def test_inflate_refuses_broken_bodies(raw: bytes, why: str) -> None:
    with pytest.raises(ProxyError) as err:
        _inflate(raw, "gzip", 1 << 20)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and why in err.value.message


@pytest.mark.parametrize(("header", "coding"), [
    ("", None), ("identity", None), ("gzip", "gzip"), ("deflate", "deflate"),
    ("br, gzip;q=0.8", "gzip"), ("gzip;q=0, deflate", "deflate"),
    # as Triton's HTTP front reads it: names exact, by weight then order, stod's reading
    ("GZIP", None), ("gzip;q=0.5, deflate", "deflate"), ("gzip; q=0.5", None),
    ("identity, gzip;q=0.1", None), ("deflate;q=abc, gzip", "gzip"), ("gzip;q=1e999", None),
    ("gzip;q=0.7, deflate;q=0.7", "gzip"), ("gzip;q=0.5x", "gzip"), ("gzip;q= 0.5", "gzip"),
])
def test_answer_coding_follows_accept_encoding(header: str, coding: str | None) -> None:
    assert answer_coding(header) == coding
