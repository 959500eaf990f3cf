"""OpenAI-compatible requests as a ``Call``: the JSON stays JSON, with a typed view for filters.

``ChatView`` exposes the text parts, the images (``data:`` URLs decoded to arrays only when a
filter asks) and ``max_tokens``, and lets a filter change them; any change drops the original
bytes so the request is re-encoded. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from numpy.typing import NDArray

from proxy.call import Call, Wire
from proxy.errors import STATUS, ErrorKind, ProxyError
from proxy.image_decode import MAX_IMAGE_PIXELS as MAX_IMAGE_PIXELS  # where it was
from proxy.image_decode import decode_rgb

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_ERROR_TYPES = {
    ErrorKind.INVALID_ARGUMENT: "BadRequestError", ErrorKind.UNPROCESSABLE: "BadRequestError",
    ErrorKind.NOT_FOUND: "NotFoundError", ErrorKind.TOO_LARGE: "BadRequestError",
    ErrorKind.OVERLOADED: "RateLimitError", ErrorKind.UNAVAILABLE: "ServiceUnavailableError",
    ErrorKind.DEADLINE_EXCEEDED: "TimeoutError", ErrorKind.UNIMPLEMENTED: "NotImplementedError",
    ErrorKind.UNAUTHENTICATED: "AuthenticationError",
    ErrorKind.PERMISSION_DENIED: "PermissionDeniedError",
}


def error_body(kind: ErrorKind, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(kind, "InternalServerError"),
                      "param": param, "code": STATUS[kind].http}}




def _check_messages(messages: list[Any]) -> None:
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad(f"messages[{i}].content must be a string or a list of parts",
                      f"messages[{i}].content")
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise bad(f"{where} must be an object", where)
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise bad(f"{where}.text must be a string", f"{where}.text")


def _check_prompt(prompt: Any) -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists (vLLM)."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in x)
    if isinstance(prompt, str) or ids(prompt):
        return
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(ids(p) for p in prompt)):
        return
    raise bad("'prompt' must be a string, a list of strings or a list of token ids", "prompt")


def bad(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message, param=param)


def decode_request(body: bytes, endpoint: str, allowed_hosts: frozenset[str]) -> Call:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"malformed JSON in the request body: {exc}") from None
    except RecursionError:
        raise bad("the JSON in the request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise bad("the request body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    if endpoint == CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty list", "messages")
        _check_messages(messages)
    elif "prompt" not in doc:
        raise bad("'prompt' is required", "prompt")
    else:
        _check_prompt(doc["prompt"])
        if "messages" in doc:
            raise bad("a completion takes a 'prompt', not 'messages'", "messages")
    call = Call(model=model, version="", inputs=[], front="openai",
                streaming=bool(doc.get("stream", False)), wire=Wire("openai", body),
                document=doc, endpoint=endpoint)
    for image in ChatView(call).images():
        check_image_url(image.url, allowed_hosts, image.param)
    return call


def check_image_url(url: str, allowed_hosts: frozenset[str], param: str) -> None:
    """``data:`` URLs pass; a remote URL would make the backend fetch it, so only allow-listed
    hosts pass (a client must not turn the model server into a fetcher of arbitrary URLs)."""
    if url.startswith("data:"):
        return
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError as exc:
        raise bad(f"{param}: not a valid URL: {exc}", param) from None
    if parts.scheme not in ("http", "https"):
        raise bad(f"{param}: unsupported image URL scheme {parts.scheme!r}; use a data: URL",
                  param)
    if host not in allowed_hosts:
        raise bad(f"{param}: remote image URLs are refused by mmguard (host {host!r} is not on "
                  "openai.image_url_allow_hosts); send the image inline as a data: URL", param)


@dataclass
class ImagePart:
    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url"

    def bytes(self) -> bytes:
        """The image file bytes of a data: URL."""
        head, _, data = self.url.partition(",")
        if not head.startswith("data:") or not head.endswith(";base64"):
            raise bad(f"{self.param}: not a base64 data: URL", self.param)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad(f"{self.param}: invalid base64: {exc}", self.param) from None

    def array(self, max_side: int | None = None) -> NDArray[np.uint8]:
        """Decoded pixels, H × W × 3 uint8 (decoded now, not at request time), under the
        process-wide decode budget; with ``max_side``, reduced while decoding (short side
        between max_side and twice it). See ``proxy.image_decode``."""
        return decode_rgb(self.bytes(), self.param, max_side)


class ChatView:
    """Read and edit an OpenAI request's content on the call."""

    def __init__(self, call: Call) -> None:
        assert call.document is not None, "not an OpenAI call"
        self.call = call
        self.doc = call.document

    def _parts(self) -> list[tuple[int, int, dict[str, Any]]]:
        out: list[tuple[int, int, dict[str, Any]]] = []
        for m_i, msg in enumerate(self.doc.get("messages") or []):
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, list):
                out.extend((m_i, p_i, p) for p_i, p in enumerate(content) if isinstance(p, dict))
        return out

    def texts(self) -> list[str]:
        """Every text the model reads: prompt(s), string contents and text parts, in order."""
        prompt = self.doc.get("prompt")
        if prompt is not None:
            return [prompt] if isinstance(prompt, str) else [p for p in prompt
                                                             if isinstance(p, str)]
        out: list[str] = []
        for msg in self.doc.get("messages") or []:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                out.append(content)
            elif isinstance(content, list):
                out.extend(p.get("text", "") for p in content
                           if isinstance(p, dict) and p.get("type") == "text")
        return out

    def images(self) -> list[ImagePart]:
        out: list[ImagePart] = []
        for m_i, p_i, part in self._parts():
            if part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str):
                    raise bad(f"messages[{m_i}].content[{p_i}].image_url needs a 'url' string")
                out.append(ImagePart(m_i, p_i, url))
        return out

    @property
    def max_tokens(self) -> int | None:
        value = self.doc.get("max_completion_tokens", self.doc.get("max_tokens"))
        return value if isinstance(value, int) else None

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        key = "max_completion_tokens" if "max_completion_tokens" in self.doc else "max_tokens"
        self.doc[key] = value
        self.call.wire = None

    def drop_image(self, image: ImagePart) -> None:
        content = self.doc["messages"][image.message]["content"]
        del content[image.part]
        self.call.wire = None

    def replace_text(self, index: int, text: str) -> None:
        """Replace the index-th text of ``texts()``."""
        seen = 0
        if "prompt" in self.doc:
            if isinstance(self.doc["prompt"], str):
                self.doc["prompt"] = text
            else:
                self.doc["prompt"][index] = text
            self.call.wire = None
            return
        for msg in self.doc.get("messages") or []:
            content = msg.get("content")
            if isinstance(content, str):
                if seen == index:
                    msg["content"] = text
                    self.call.wire = None
                    return
                seen += 1
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "text":
                        if seen == index:
                            part["text"] = text
                            self.call.wire = None
                            return
                        seen += 1
        raise IndexError(index)


def encode_request(call: Call, model: str) -> bytes:
    """The body for the backend: the client's own bytes when nothing changed."""
    if call.wire is not None and call.wire.protocol == "openai" and model == call.model:
        return call.wire.body
    assert call.document is not None
    return json.dumps({**call.document, "model": model}, separators=(",", ":")).encode()
