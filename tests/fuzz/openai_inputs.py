"""OpenAI chat / completions bodies and ``data:`` image URLs for the fuzzers.

Images are small real files (PNG, JPEG, GIF, BMP, TIFF in several modes) made once with PIL,
then broken: truncated, bit-flipped, mislabelled, badly base64-encoded, or replaced by a
decompression bomb (a tiny file that declares or really holds a huge picture).
"""

from __future__ import annotations

import base64
import functools
import io
import struct
import zlib
from typing import Any

from hypothesis import strategies as st

from proxy.wire.openai import CHAT, COMPLETIONS
from tests.fuzz.mutations import dumps, hostile_json, json_scalars, json_values, mutated_bytes

ALLOWED_HOST = "images.example.com"
ALLOWED_HOSTS = frozenset({ALLOWED_HOST})
ENDPOINTS = [CHAT, COMPLETIONS]


@functools.cache
def sample_images() -> tuple[tuple[str, bytes], ...]:
    """(mime type, file bytes) of small valid pictures in the formats a client may send."""
    from PIL import Image

    out = []
    for fmt, mime, mode in [("PNG", "image/png", "RGB"), ("PNG", "image/png", "RGBA"),
                            ("PNG", "image/png", "P"), ("PNG", "image/png", "I;16"),
                            ("PNG", "image/png", "1"), ("JPEG", "image/jpeg", "RGB"),
                            ("JPEG", "image/jpeg", "CMYK"), ("GIF", "image/gif", "P"),
                            ("BMP", "image/bmp", "L"), ("TIFF", "image/tiff", "RGB")]:
        img = Image.new(mode, (7, 5))
        buf = io.BytesIO()
        img.save(buf, fmt)
        out.append((mime, buf.getvalue()))
    return tuple(out)


def _png(width: int, height: int, idat: bytes, bit_depth: int = 8) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)  # greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


@functools.cache
def bombs() -> tuple[bytes, ...]:
    """Files that make a decoder allocate far more than they weigh.

    A header alone declaring 20,000² / 65,535 × 1 / 1 × 2³¹−1 pixels, and one real bomb: a
    9,500² 1-bit PNG of zeros (11 KB on the wire, 270 MB as the RGB pixels a filter asks for),
    under PIL's own refusal threshold (2 × 89 Mpx) but over its warning one."""
    rows = zlib.compress(b"\x00" * (1 + 9_500 // 8 + 1) * 9_500, 9)
    return (_png(20_000, 20_000, zlib.compress(b"")), _png(65_535, 1, b""),
            _png(1, 2**31 - 1, b""), _png(9_500, 9_500, rows, bit_depth=1))


@st.composite
def image_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """(mime type, file bytes), valid or broken."""
    way = draw(st.sampled_from(["valid", "truncated", "mutated", "mislabelled", "bomb",
                                "garbage"]))
    mime, data = draw(st.sampled_from(sample_images()))
    if way == "truncated":
        return mime, data[:draw(st.integers(0, len(data) - 1))]
    if way == "mutated":
        return mime, draw(mutated_bytes(data, max_ops=2))
    if way == "mislabelled":
        return draw(st.sampled_from(["text/plain", "image/svg+xml", "application/pdf", ""])), data
    if way == "bomb":
        return "image/png", draw(st.sampled_from(bombs()))
    if way == "garbage":
        return mime, draw(st.binary(max_size=64))
    return mime, data


@st.composite
def data_urls(draw: st.DrawFn) -> str:
    mime, data = draw(image_files())
    b64 = base64.b64encode(data).decode()
    way = draw(st.sampled_from(["ok", "ok", "ok", "bad_char", "bad_padding", "no_base64",
                                "urlsafe", "whitespace", "no_comma", "empty"]))
    if way == "bad_char" and b64:
        pos = draw(st.integers(0, len(b64) - 1))
        b64 = b64[:pos] + draw(st.sampled_from(["!", "*", "é", "\u0000", "-", "_"])) + b64[pos:]
    elif way == "bad_padding":
        b64 = b64.rstrip("=") + draw(st.sampled_from(["", "=", "===", "A"]))
    elif way == "urlsafe":
        b64 = base64.urlsafe_b64encode(data).decode()
    elif way == "whitespace" and b64:
        b64 = b64[: len(b64) // 2] + "\n " + b64[len(b64) // 2:]
    if way == "no_base64":
        return f"data:{mime},{b64}"
    if way == "no_comma":
        return f"data:{mime};base64"
    if way == "empty":
        return "data:"
    return f"data:{mime};base64,{b64}"


def remote_urls() -> st.SearchStrategy[str]:
    hosts = st.sampled_from([ALLOWED_HOST, ALLOWED_HOST.upper(), "evil.example.com",
                             "169.254.169.254", "localhost", "[::1]", "", "images.example.com.",
                             "user@images.example.com"])
    return st.one_of(
        st.builds(lambda s, h, p: f"{s}://{h}{p}",
                  st.sampled_from(["http", "https", "HTTP", "ftp", "file", "gopher", ""]),
                  hosts, st.sampled_from(["", "/a.png", ":80/a.png", ":99999/", ":x/"])),
        st.sampled_from(["http://[::1", "http://[zz]/", "https://[", "//images.example.com/x",
                         "javascript:alert(1)", "data", "http://\u2100.example/",
                         "http://images.example.com\\@evil.example.com/"]),
        st.text(max_size=20))


def image_urls() -> st.SearchStrategy[str]:
    return st.one_of(data_urls(), remote_urls())


@st.composite
def _content(draw: st.DrawFn) -> Any:
    parts: list[Any] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["text", "text", "image", "image_bare", "odd"]))
        if kind == "text":
            parts.append({"type": "text", "text": draw(st.text(max_size=20) | json_scalars())})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": draw(image_urls())}})
        elif kind == "image_bare":
            parts.append({"type": "image_url", "image_url": draw(image_urls() | json_values(3))})
        else:
            parts.append(draw(json_values(4)))
    return draw(st.just(parts) | st.text(max_size=20) | json_values(4))


@st.composite
def openai_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": draw(st.sampled_from(["tiny-llama", "clip_demo", ""])
                                         | st.text(max_size=8))}
    if draw(st.booleans()):
        doc["messages"] = [{"role": draw(st.sampled_from(["user", "system", "assistant"])),
                            "content": draw(_content())}
                           for _ in range(draw(st.integers(1, 3)))]
    else:
        doc["prompt"] = draw(st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=3)
                             | json_values(4))
    for key in draw(st.lists(st.sampled_from(["stream", "max_tokens", "max_completion_tokens",
                                              "messages", "model", "temperature"]),
                             max_size=2)):
        doc[key] = draw(json_values(4))
    return doc


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    """(body, endpoint)."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    way = draw(st.sampled_from(["arbitrary", "structured", "structured", "hostile", "mutated"]))
    if way == "arbitrary":
        return draw(st.binary(max_size=256)), endpoint
    doc = draw(openai_docs())
    if way == "hostile":
        return draw(hostile_json(doc)), endpoint
    body = dumps(doc)
    return (draw(mutated_bytes(body)) if way == "mutated" else body), endpoint
