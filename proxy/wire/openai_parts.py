"""Every place in an OpenAI-style body where vLLM reads media, so mmguard checks each of them.

Two walks, both over the parsed JSON:

- ``check_content`` reads a message's content parts the way vLLM 0.32 does: a part with a known
  ``type`` and no ``uuid`` is what its type says; a part with a ``uuid`` or without a ``type`` is
  whatever its first media key is (``{"image_url": …}`` with no type is an image). A part type
  mmguard does not know, or media mmguard cannot inspect (embeddings, PIL images, files), is
  refused with the part named. A part that carries only a ``uuid`` (vLLM's cache reference) passes.
- ``url_sites`` finds every string under a key named ``url`` or ``*_url`` anywhere in the body
  (image, audio and video parts, ``server_url`` of a tool, …): each is a URL the backend might
  fetch, and each must be a ``data:`` URL or pass the allow-list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from proxy.wire.media_urls import refused

TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                        "tool_reference"})
IMAGE_TYPES = frozenset({"image_url", "input_image"})
URL_MEDIA_TYPES = frozenset({"audio_url", "video_url"})  # fetched by vLLM like images
INLINE_MEDIA_TYPES = frozenset({"input_audio"})  # base64 inside the request; nothing fetched
UNINSPECTABLE = {
    "image_embeds": "image embeddings", "audio_embeds": "audio embeddings",
    "video_embeds": "video embeddings", "prompt_embeds": "prompt embeddings",
    "image_pil": "in-process PIL images", "input_file": "files", "file": "files",
}
# The keys vLLM looks for, in its order, when a part has a uuid or no type.
_FALLBACK_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
                  "prompt_embeds", "audio_url", "input_audio", "video_url", "tool_reference")


def part_kind(part: dict[str, Any], where: str) -> str | None:
    """What vLLM will read this part as; ``None`` for a bare cache reference (uuid only)."""
    kind = part.get("type")
    if part.get("uuid") is not None or kind is None:
        found = next((k for k in _FALLBACK_KEYS if k in part), None)
        if found is None and part.get("uuid") is None:
            raise refused(f"{where}: a content part needs a 'type' (e.g. 'text' or 'image_url')",
                          f"{where}.type")
        return found
    if not isinstance(kind, str):
        raise refused(f"{where}.type must be a string, not {type(kind).__name__}",
                      f"{where}.type")
    return kind


def check_part(part: Any, where: str) -> None:
    if isinstance(part, str):
        return  # vLLM reads a bare string part as text
    if not isinstance(part, dict):
        raise refused(f"{where} must be an object or a string", where)
    kind = part_kind(part, where)
    if kind is None or kind in INLINE_MEDIA_TYPES:
        return
    if kind in UNINSPECTABLE:
        raise refused(f"{where}: content parts of type {kind!r} are refused by mmguard: its "
                      f"guards cannot inspect {UNINSPECTABLE[kind]}", f"{where}.type")
    if kind in TEXT_TYPES:
        text_key = "name" if kind == "tool_reference" else kind if kind in (
            "refusal", "thinking") else "text"
        if "uuid" not in part and not isinstance(part.get(text_key), str):
            raise refused(f"{where}.{text_key} must be a string", f"{where}.{text_key}")
        return
    if kind in IMAGE_TYPES or kind in URL_MEDIA_TYPES:
        if media_url(part, kind) is None and part.get("uuid") is None:
            key = "image_url" if kind == "input_image" else kind
            raise refused(f"{where}.{key} needs a URL string (or a 'url' in an object)",
                          f"{where}.{key}")
        return
    known = sorted(TEXT_TYPES | IMAGE_TYPES | URL_MEDIA_TYPES | INLINE_MEDIA_TYPES)
    raise refused(f"{where}: unknown content part type {kind!r}; mmguard passes only "
                  f"{', '.join(known)}", f"{where}.type")


def media_url(part: dict[str, Any], kind: str) -> str | None:
    """The URL vLLM reads from an image / audio / video part (``None`` when there is none)."""
    key = "image_url" if kind == "input_image" else kind
    value = part.get(key)
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise refused(f"{where} must be a string or a list of parts", where)
    for j, part in enumerate(content):
        check_part(part, f"{where}[{j}]")


def check_messages(messages: Any, key: str = "messages") -> None:
    if not isinstance(messages, list) or not messages:
        raise refused(f"'{key}' must be a non-empty list", key)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise refused(f"{key}[{i}] must be an object", f"{key}[{i}]")
        check_content(msg.get("content"), f"{key}[{i}].content")


def check_responses_input(value: Any) -> None:
    """``/v1/responses`` ``input``: a string, or items; messages' parts are checked like chat's,
    and a tool call's output that is a list of parts too."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise refused("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise refused(f"{where} must be an object", where)
        if item.get("type", "message") == "message":
            check_content(item.get("content"), f"{where}.content")
        elif isinstance(item.get("output"), list):
            check_content(item["output"], f"{where}.output")


@dataclass
class UrlSite:
    """A URL string in the body: ``holder[key]`` at JSON path ``where``."""

    holder: dict[str, Any]
    key: str
    where: str
    image: bool  # an image URL (mmguard can fetch and inline it), not audio, video or other

    @property
    def url(self) -> str:
        return str(self.holder[self.key])

    @property
    def remote(self) -> bool:
        return self.url[:5].lower() != "data:"


def _url_key(key: str) -> bool:
    return key in ("url", "uri") or key.endswith(("_url", "_uri"))


def url_sites(doc: Any) -> Iterator[UrlSite]:
    """Every string under a URL-like key, anywhere in the document (iterative: the JSON may be
    as deep as the parser allows)."""
    stack: list[tuple[Any, str, str]] = [(doc, "", "")]
    while stack:
        node, where, parent_key = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():  # a path is written only for what needs one
                if isinstance(value, str):
                    if isinstance(key, str) and _url_key(key):
                        image = key == "image_url" or (key == "url" and parent_key == "image_url")
                        yield UrlSite(node, key, f"{where}.{key}" if where else key, image)
                elif isinstance(value, (dict, list)):
                    stack.append((value, f"{where}.{key}" if where else str(key), str(key)))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", parent_key) for i, v in enumerate(node)
                         if isinstance(v, (dict, list)))
