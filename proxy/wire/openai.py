"""OpenAI-compatible requests as a ``Call``: the JSON stays JSON, with a typed view for filters.

``decode_request`` checks a body for the endpoint it came to (chat, completions, responses,
embeddings, pooling, tokenize, SageMaker's invocations): every content part vLLM would read
(``proxy.wire.openai_parts``) and every URL anywhere in the body (``proxy.wire.media_urls``): a
``data:`` URL passes, a remote one must be allow-listed and is sent on as mmguard parsed it.

``ChatView`` exposes the texts, the images (``data:`` URLs decoded to arrays only when a filter
asks) and the output-token limit, and lets a filter change them; any change drops the original
bytes so the request is re-encoded. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import TypeAdapter, ValidationError

from proxy.call import Api, Call, Wire
from proxy.errors import STATUS, ErrorKind, ProxyError
from proxy.wire import openai_parts, vllm_words
from proxy.wire.image_decode import MAX_IMAGE_PIXELS as MAX_IMAGE_PIXELS  # where it was
from proxy.wire.image_decode import decode_rgb
from proxy.wire.media_urls import HostAllowList
from proxy.wire.numbers import json_loads

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
POOLING = "/pooling"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
INVOCATIONS = "/invocations"
INFERENCE = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, POOLING, INVOCATIONS)
"""Endpoints whose calls go through the model's filter chain."""

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




@dataclass(frozen=True)
class MediaPolicy:
    """What remote media a request may name: the allow-list, and who fetches (``fetch``: mmguard,
    then inline; ``forward``: the backend, from the URL mmguard re-wrote)."""

    allow: HostAllowList = field(default_factory=lambda: HostAllowList(frozenset()))
    mode: Literal["fetch", "forward"] = "forward"
    max_remote: int = 8


_PROMPT = TypeAdapter(list[int] | list[list[int]] | str | list[str])
"""vLLM's type for a prompt, read as its request model reads it (pydantic, lax): a token id
may come as ``true``, ``1.0`` or ``"1"``, and vLLM serves it."""


def _check_prompt(prompt: Any, key: str = "prompt") -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists (vLLM)."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(type(t) is int for t in x)
    if isinstance(prompt, str) or ids(prompt):
        return
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(ids(p) for p in prompt)):
        return
    try:  # what vLLM's lax reading takes (a bool or a float as a token id) is served
        _PROMPT.validate_python(prompt)
    except ValidationError:
        raise bad(f"'{key}' must be a string, a list of strings or a list of token ids",
                  key) from None


def bad(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message, param=param)


def _check_completion(doc: dict[str, Any]) -> None:
    if doc.get("prompt_embeds") is not None:
        raise bad("'prompt_embeds' is refused by mmguard: its guards cannot inspect prompt "
                  "embeddings; send the prompt as text or token ids", "prompt_embeds")
    if "prompt" not in doc:
        raise bad(vllm_words.NO_PROMPT, "prompt")
    _check_prompt(doc["prompt"])


def _check_body(doc: dict[str, Any], endpoint: str) -> None:
    """The fields the endpoint reads, where vLLM would read content or media from them."""
    if endpoint == CHAT:
        if "messages" not in doc:
            raise vllm_words.missing("body.messages", doc)
        if not isinstance(doc["messages"], list):
            raise vllm_words.not_a_list("body.messages", doc["messages"])
        if not doc["messages"]:
            raise bad(vllm_words.EMPTY_CONVERSATION)
        openai_parts.check_messages(doc["messages"])
    elif endpoint == COMPLETIONS:
        _check_completion(doc)
    elif endpoint == RESPONSES:
        if "input" not in doc:
            raise bad("'input' is required", "input")
        openai_parts.check_responses_input(doc["input"])
    elif endpoint in (EMBEDDINGS, POOLING, TOKENIZE):
        if "messages" in doc:
            openai_parts.check_messages(doc["messages"])
        elif endpoint == TOKENIZE:
            _check_prompt(doc.get("prompt"))
        elif "input" not in doc:
            raise bad("'input' (or 'messages') is required", "input")
        else:
            _check_prompt(doc["input"], "input")
    elif endpoint == INVOCATIONS:
        if "messages" in doc:
            openai_parts.check_messages(doc["messages"])
        elif "prompt" in doc:
            _check_completion(doc)
        else:
            raise bad("/invocations through mmguard takes a chat body ('messages') or a "
                      "completion body ('prompt')", "messages")


def decode_request(body: bytes, endpoint: str,
                   policy: MediaPolicy | frozenset[str] = MediaPolicy()) -> Call:
    """``parse_request``, then every URL in it checked against ``policy``."""
    if not isinstance(policy, MediaPolicy):
        policy = MediaPolicy(HostAllowList.of(policy))
    call = parse_request(body, endpoint)
    assert call.document is not None
    if apply_url_policy(call.document, policy):
        call.wire = None
    return call


def parse_request(body: bytes, endpoint: str) -> Call:
    """The body as a call, its content parts checked for the endpoint (URLs not yet)."""
    if not body:
        raise vllm_words.missing("body", None)
    try:
        doc = json_loads(body)
    except json.JSONDecodeError as exc:
        raise vllm_words.not_json(exc) from None
    except UnicodeDecodeError:
        raise vllm_words.not_utf8() from None
    except ValueError as exc:
        raise bad(f"malformed JSON in the request body: {exc}") from None
    except RecursionError:
        raise bad("the JSON in the request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise vllm_words.not_an_object(doc)
    model = doc.get("model")
    if model is None:  # vLLM answers with its served model: so does the front (one route)
        model = ""
    if not isinstance(model, str):
        raise vllm_words.not_a_string("body.model", model)
    _check_body(doc, endpoint)
    wire: Wire | None = Wire("openai", body)
    if endpoint == COMPLETIONS and "messages" in doc:
        # vLLM ignores 'messages' beside a completion's prompt: dropped, so no guard reads
        # (or fetches) what the model never sees; the body is written anew without them
        del doc["messages"]
        wire = None
    return Call(model=model, version="", inputs=[], front="openai",
                streaming=streaming(doc.get("stream")), wire=wire,
                document=doc, endpoint=endpoint)


_SAYS_TRUE = frozenset({"1", "t", "y", "on", "yes", "true"})


def streaming(value: Any) -> bool:
    """``stream`` as vLLM's request model (pydantic, lax) reads it: a bool; 0 / 1 (also 0.0 /
    1.0); one of "0", "f", "n", "no", "off", "false" and their "1", "t", ... "true" in any case;
    null or absent is False. Python's truth said ``"false"`` streams: vLLM answered it whole
    while mmguard read the answer as events and failed it 503, blaming the backend. A value
    pydantic refuses reads as False here: the request goes on as is, and vLLM refuses it in its
    own words."""
    if type(value) is bool:
        return bool(value)
    if type(value) in (int, float):
        return bool(value == 1)
    return isinstance(value, str) and value.lower() in _SAYS_TRUE


def apply_url_policy(doc: dict[str, Any], policy: MediaPolicy,
                     images: list[openai_parts.UrlSite] | None = None) -> int:
    """Check every URL in the body; returns how many remote URLs were re-written (each is
    sent as mmguard parsed it, so the document changed). ``forward``: each
    remote URL is replaced by mmguard's own writing of it. ``fetch``: remote images stay for
    the fetcher (checked again there; appended to ``images`` when given, so the fetcher need
    not walk the document again), any other remote URL is refused."""
    rewritten = remote = 0
    for site in openai_parts.url_sites(doc):
        if not site.remote:
            continue
        if images is not None and site.image:
            images.append(site)
        url = policy.allow.check(site.url, site.where)
        remote += 1
        if remote > policy.max_remote:
            raise bad(f"{site.where}: more than {policy.max_remote} remote URLs in one request "
                      "(openai.fetch.max_images)", site.where)
        if policy.mode == "fetch" and not site.image:
            raise bad(f"{site.where}: mmguard fetches remote images only "
                      "(openai.remote_images: fetch); the backend would fetch this URL itself; "
                      "send it inline as a data: URL", site.where)
        if policy.mode == "forward":
            site.holder[site.key] = url.text
            rewritten += 1
    return rewritten


@dataclass
class ImagePart:
    message: int
    part: int
    url: str
    where: str = ""
    """The part's JSON path; ``messages[message].content[part]`` when empty."""
    container: list[Any] | None = field(default=None, repr=False, compare=False)
    """The list the part is in (to drop it)."""

    @property
    def param(self) -> str:
        return f"{self.where or f'messages[{self.message}].content[{self.part}]'}.image_url"

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
        between max_side and twice it). See ``proxy.wire.image_decode``."""
        return decode_rgb(self.bytes(), self.param, max_side)




class ChatView:
    """Read and edit an OpenAI request's content on the call (chat ``messages``, responses
    ``input`` items, completion ``prompt``, embeddings ``input``)."""

    def __init__(self, call: Call) -> None:
        assert call.document is not None, "not an OpenAI call"
        self.call = call
        self.doc = call.document

    def _contents(self) -> list[tuple[str, dict[str, Any], str]]:
        """(path, holder, key) of every message content, in order."""
        out: list[tuple[str, dict[str, Any], str]] = []
        for key in ("messages", "input"):
            items = self.doc.get(key)
            if not isinstance(items, list):
                continue
            for i, item in enumerate(items):
                if isinstance(item, dict) and "content" in item:
                    out.append((f"{key}[{i}].content", item, "content"))
        return out

    def _parts(self) -> list[tuple[str, list[Any], int, dict[str, Any]]]:
        out: list[tuple[str, list[Any], int, dict[str, Any]]] = []
        for where, holder, key in self._contents():
            content = holder[key]
            if isinstance(content, list):
                out.extend((f"{where}[{j}]", content, j, p) for j, p in enumerate(content)
                           if isinstance(p, dict))
        return out

    def _text_slots(self) -> list[tuple[Any, Any]]:
        """(holder, key) of every text the model reads, in order."""
        slots: list[tuple[Any, Any]] = []
        for key in ("prompt", "input"):
            value = self.doc.get(key)
            if isinstance(value, str):
                slots.append((self.doc, key))
            elif isinstance(value, list) and (key == "prompt"
                                              or self.call.endpoint != RESPONSES):
                slots.extend((value, i) for i, p in enumerate(value) if isinstance(p, str))
        for _, holder, key in self._contents():
            content = holder[key]
            if isinstance(content, str):
                slots.append((holder, key))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") in ("text", "input_text") \
                            and isinstance(part.get("text"), str):
                        slots.append((part, "text"))
        return slots

    def texts(self) -> list[str]:
        """Every text the model reads: prompt(s), string contents and text parts, in order."""
        return [holder[key] for holder, key in self._text_slots()]

    def images(self) -> list[ImagePart]:
        """The images vLLM will read, as it reads them (a part with a uuid or no type is what its
        first media key says); a part that only names a uuid has nothing to inspect."""
        out: list[ImagePart] = []
        for n, (where, container, j, part) in enumerate(self._parts()):
            kind = openai_parts.part_kind(part, where)
            if kind in openai_parts.IMAGE_TYPES:
                url = openai_parts.media_url(part, kind)
                if url is not None:
                    out.append(ImagePart(n, j, url, where, container))
        return out

    _LIMIT_KEYS = ("max_completion_tokens", "max_output_tokens", "max_tokens")

    @property
    def max_tokens(self) -> int | None:
        for key in self._LIMIT_KEYS:
            value = self.doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        key = next((k for k in self._LIMIT_KEYS if k in self.doc),
                   "max_output_tokens" if self.call.endpoint == RESPONSES else "max_tokens")
        self.doc[key] = value
        self.call.wire = None

    def drop_image(self, image: ImagePart) -> None:
        container = image.container
        if container is None:
            container = self.doc["messages"][image.message]["content"]
        del container[image.part]
        self.call.wire = None

    def replace_text(self, index: int, text: str) -> None:
        """Replace the index-th text of ``texts()``."""
        slots = self._text_slots()
        if not 0 <= index < len(slots):
            raise IndexError(index)
        holder, key = slots[index]
        holder[key] = text
        self.call.wire = None


def encode_request(call: Call, model: str) -> bytes:
    """The body for the backend: the client's own bytes when nothing changed."""
    if call.wire is not None and call.wire.api is Api.OPENAI and model == call.model:
        return call.wire.body
    assert call.document is not None
    return json.dumps({**call.document, "model": model}, separators=(",", ":")).encode()
