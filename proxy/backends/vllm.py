"""vLLM over its OpenAI-compatible HTTP API: inference calls on the lean keep-alive client of
``http_client`` (or the aiohttp session, ``infer_client: aiohttp``), every other call on the
session; SSE forwarded as it arrives.

The contract comes from ``/v1/models`` (``max_model_len``) and ``/version``; whether the model
takes images is declared in config or probed once with a one-token request. Token counts come
from ``/tokenize``. Streams are read as events arrive and handed on at once; a backend that dies
mid-stream ends the stream with an error item instead of leaving the client hanging.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from proxy.backends.fingerprint import PROBES, tokenizer_part
from proxy.backends.http_base import HttpBackend
from proxy.backends.http_client import AnswerTooLarge, Body
from proxy.backends.propagation import forward_headers
from proxy.call import (
    Call,
    LocalReply,
    Result,
    SseEvents,
    SseStream,
    StreamItem,
    Target,
    Wire,
)
from proxy.config.backends import VllmBackendConfig
from proxy.contract import ModelContract, fingerprint
from proxy.errors import ErrorKind, ProxyError
from proxy.telemetry import backend_span, gen_ai_usage, traced_stream
from proxy.wire import openai
from proxy.wire.sse import SseEventTooLarge, SseSplitter

log = logging.getLogger("mmguard.vllm")

# A 28 × 28 grey PNG: the smallest image the tiny test models and real ones all accept.
_PROBE_PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d494844520000001c0000001c0800000000576680"
    "48000000144944415478da6368c00318462547254725610000d78f8810b49db6"
    "7c0000000049454e44ae426082")).decode()


class VllmBackend(HttpBackend):
    protocol = "openai"

    def __init__(self, cfg: VllmBackendConfig) -> None:
        super().__init__(cfg.name, cfg.url, cfg.timeout_s, cfg.pool_size, tls=cfg.tls,
                         max_message_bytes=cfg.max_message_bytes)
        self.cfg = cfg
        self._use_lean_client(cfg.infer_client)
        self._accepts_images: dict[str, bool | None] = {}

    live_path = "/health"

    async def ready(self) -> bool:
        return await self._ok("/health")

    async def model_ready(self, model: str, version: str = "") -> bool:
        return await self.ready()

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        models = await self._get_json("/v1/models", model)
        entry = next((m for m in models.get("data", []) if m.get("id") == model), None)
        if entry is None:
            # the count only: this message can reach an unauthenticated caller
            served = len(models.get("data", []))
            raise ProxyError(ErrorKind.NOT_FOUND,
                             f"backend '{self.name}' does not serve '{model}' (it serves "
                             f"{served} model(s); its /v1/models lists them)")
        server_version = (await self._get_json("/version", model)).get("version", "")
        images = await self._image_input(model)
        tokenizer = await self._tokenizer_fingerprint(model)  # the version fuse sees tokenizers
        return ModelContract(
            name=model, versions=("1",), platform=f"vllm {server_version}".strip(), inputs=(),
            outputs=(), context_length=entry.get("max_model_len"), accepts_images=images,
            fingerprint=fingerprint(entry.get("root"), entry.get("max_model_len"),
                                    server_version, tokenizer),
            config={"name": model, "backend": "vllm", "max_model_len": entry.get("max_model_len"),
                    "root": entry.get("root"), "vllm_version": server_version,
                    "tokenizer": tokenizer, "model_entry": entry},
        )

    async def _tokenizer_fingerprint(self, model: str) -> dict[str, Any]:
        """``/tokenizer_info`` (when the server exposes it) and the probe set's token ids."""
        info: dict[str, Any] | None = None
        try:
            async with self.session.get(self.base + "/tokenizer_info",
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status == 200:
                    doc = json.loads(await self._read(r, model))
                    info = doc if isinstance(doc, dict) else None
        except (aiohttp.ClientError, ValueError):
            info = None
        ids: list[list[int]] | None = []
        for text in PROBES:
            status, body = await self.tokenize("/tokenize", json.dumps(
                {"model": model, "prompt": text}).encode(), {})
            if status == 404 and ids == []:
                # An OpenAI-compatible server without vLLM's /tokenize: the fingerprint goes
                # without probe ids (the fuse then sees only what /v1/models and
                # /tokenizer_info show) rather than the route never becoming ready.
                log.debug("backend %r has no /tokenize: fingerprint without probe ids",
                          self.name)
                ids = None
                break
            if status != 200:
                raise self._status_error(status, body)
            assert ids is not None
            ids.append([int(t) for t in json.loads(body).get("tokens", [])])
        return tokenizer_part(info, ids)

    async def _image_input(self, model: str) -> bool | None:
        if self.cfg.image_input != "auto":
            return self.cfg.image_input == "yes"
        if model not in self._accepts_images:
            probe = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_PROBE_PNG}"}},
            ]}]}
            try:
                async with self.session.post(self.base + openai.CHAT, json=probe,
                                             timeout=aiohttp.ClientTimeout(total=60)) as r:
                    await self._read(r, model)
                    self._accepts_images[model] = (True if r.status == 200 else
                                                   False if r.status == 400 else None)
            except (aiohttp.ClientError, TimeoutError):
                return None
        return self._accepts_images[model]

    async def forward(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """One vLLM endpoint that needs no filters (/tokenize, /version, /health, ...), passed
        through as it is: (status, content type, body)."""
        sent = forward_headers(headers or {})
        if body is not None:
            sent["Content-Type"] = "application/json"
        if self.pool is not None and method == "POST" and body is not None:  # /tokenize: hot
            head = self._lean_head(path, sent, len(body))
            try:
                async with asyncio.timeout(self.timeout_s):
                    answer = await self.pool.request(head, (body,))
            except AnswerTooLarge as exc:
                raise self.too_large_error(exc, path) from None
            except OSError as exc:
                raise self._transport_error(exc, path) from None
            return answer.status, answer.headers.get("content-type", ""), answer.body
        try:
            async with self.session.request(
                    method, self.base + path, data=body, headers=sent,
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                return r.status, r.headers.get("Content-Type", ""), await self._read(r, path)
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, path) from None

    async def tokenize(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """/tokenize and /detokenize, passed through as they are."""
        status, _, out = await self.forward("POST", path, body, headers)
        return status, out

    async def count_tokens(self, call: Call, model: str) -> int:
        """Prompt tokens as the backend's own tokenizer counts them (chat template included);
        for a list of prompts (completions, embeddings), the longest of the first
        :data:`COUNTED_PROMPTS` (one /tokenize call each)."""
        counts: list[int] = []
        for req in _token_requests(call):
            if isinstance(req, int):
                counts.append(req)
                continue
            status, body = await self.tokenize("/tokenize", json.dumps(
                {"model": model, **req}).encode(), {})
            if status != 200:
                raise self._status_error(status, body)
            counts.append(int(json.loads(body)["count"]))
        return max(counts, default=0)

    def _request(self, call: Call, target: Target) -> tuple[str, bytes, dict[str, str]]:
        body = openai.encode_request(call, target.model)
        headers = forward_headers(call.headers)
        headers["Content-Type"] = "application/json"
        return self.base + call.endpoint, body, headers

    async def infer(self, call: Call, target: Target) -> Result:
        with backend_span(call, "openai", self.name, target.model, self.base) as span:
            result = await self._infer_once(call, target)
            if span.is_recording() and result.wire is not None:
                gen_ai_usage(span, _json_or_none(result.wire.body))
            return result

    async def _infer_once(self, call: Call, target: Target) -> Result:
        url, body, headers = self._request(call, target)
        timeout = self.timeout_for(call)
        if self.pool is not None:
            head = self._lean_head(call.endpoint, headers, len(body))
            answer = await self._lean_post(head, (body,), timeout, target)
            if answer.status != 200:
                raise self._status_error(answer.status, answer.body)
            return Result(target.model, wire=Wire("openai", answer.body))
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(url, data=body, headers=headers) as r:
                    data = await self._read(r, target.model)
                    if r.status != 200:
                        raise self._status_error(r.status, data)
        except TimeoutError:
            raise self.deadline_error(target, timeout) from None
        except aiohttp.ClientError as exc:
            raise self._transport_error(exc, target.model) from None
        return Result(target.model, wire=Wire("openai", data))

    def stream(self, call: Call, target: Target) -> AsyncIterator[StreamItem]:
        return traced_stream(call, "openai", self.name, target.model, self.base,
                             SseStream(self._reads(call, target)))

    async def _reads(self, call: Call, target: Target
                     ) -> AsyncGenerator[SseEvents | LocalReply, None]:
        url, body, headers = self._request(call, target)
        timeout = self.timeout_for(call)
        if self.pool is not None:
            head = self._lean_head(call.endpoint, headers, len(body))
            streamed = await self._lean_stream(head, (body,), timeout, target)
            status, release = streamed.status, streamed.release
            read_body: Callable[[], Awaitable[bytes]] = streamed.body.read_all
            streamed.body.watch_idle(self.cfg.stream_idle_timeout_s)
            chunks = _lean_chunks(streamed.body, call.deadline)
        else:
            try:
                # The deadline bounds the wait for the answer to start; a long stream may run on.
                async with asyncio.timeout(timeout):
                    resp = await self.session.post(url, data=body, headers=headers)
            except TimeoutError:
                raise self.deadline_error(target, timeout) from None
            except aiohttp.ClientError as exc:
                raise self._transport_error(exc, target.model) from None
            status, release = resp.status, resp.release
            read_body = functools.partial(self._read, resp, target.model)
            chunks = _session_chunks(resp, self.cfg.stream_idle_timeout_s, call.deadline)
        try:
            if status != 200:
                raise self._status_error(status, await read_body())
            # \n\n, \r\n\r\n and \r\r all end an event; one that does not end within
            # max_message_bytes breaks the stream off (its connection closed by release)
            splitter = SseSplitter(self.max_message_bytes)
            async for chunk, ended in chunks:
                events = splitter.feed(chunk)
                # All that came in this read goes out together; so does the stream's end when
                # it came in the same read (vLLM's [DONE] and its last chunk often do).
                if events:
                    yield SseEvents(events, ended=ended)
            last = splitter.end()
            if last:
                yield SseEvents(last, ended=True)
            if splitter.pending.strip():
                raise ProxyError(ErrorKind.UNAVAILABLE,
                                 f"backend '{self.name}' ended the stream mid-event")
        except (AnswerTooLarge, SseEventTooLarge) as exc:
            raise self.too_large_error(exc, target.model) from None
        except TimeoutError:  # the call's deadline, or nothing came for stream_idle_timeout_s
            if call.deadline is not None and time.monotonic() >= call.deadline:
                raise ProxyError(ErrorKind.DEADLINE_EXCEEDED,
                                 f"the deadline of the call to model '{call.model}' passed "
                                 f"during its stream from backend '{self.name}'; mmguard ended "
                                 "the stream (mmguard-timeout-ms, the gRPC deadline or the "
                                 "route's timeout_s)") from None
            raise ProxyError(ErrorKind.DEADLINE_EXCEEDED,
                             f"backend '{self.name}' ({self.base}) sent nothing on the stream of "
                             f"model '{target.model}' for {self.cfg.stream_idle_timeout_s:g} s; "
                             "mmguard broke it off and closed the connection "
                             "(backends[].stream_idle_timeout_s)") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            yield LocalReply(ErrorKind.UNAVAILABLE,
                             f"backend '{self.name}' ({self.base}) broke off the stream for model "
                             f"'{target.model}': {type(exc).__name__}: {exc}")
        finally:
            release()


def _left(deadline: float | None) -> float | None:
    """Seconds to the call's deadline (``time.monotonic()``), None without one. The whole
    stream is bounded by it: each read waits at most that long (never across a ``yield``,
    which would cancel whoever reads the stream)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def _lean_chunks(body: Body, deadline: float | None) -> AsyncIterator[tuple[bytes, bool]]:
    """Each socket read of a streamed answer, and whether the answer ended with it
    (``TimeoutError`` from a body watched for silence, ``Body.watch_idle``, or at the call's
    deadline)."""
    ended = False
    while not ended:
        async with asyncio.timeout(_left(deadline)):
            chunk, ended = await body.read()
        if chunk:
            yield chunk, ended


async def _session_chunks(resp: aiohttp.ClientResponse, idle_s: float, deadline: float | None
                          ) -> AsyncIterator[tuple[bytes, bool]]:
    while True:
        left = _left(deadline)
        async with asyncio.timeout(idle_s if left is None else min(idle_s, left)):
            chunk = await resp.content.readany()
        if not chunk:
            return
        yield chunk, resp.content.at_eof()


def _json_or_none(body: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


COUNTED_PROMPTS = 64


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def _token_requests(call: Call) -> list[dict[str, Any] | int]:
    """/tokenize bodies that count this call's prompt(s); a token-id prompt is its length."""
    doc = call.document or {}
    if "messages" in doc:
        return [{"messages": doc["messages"]}]
    if call.endpoint == openai.RESPONSES:
        return [{"messages": _responses_messages(doc)}]
    prompt = doc.get("prompt", doc.get("input", ""))
    prompts = prompt if isinstance(prompt, list) and prompt and not _is_ids(prompt) else [prompt]
    return [len(p) if _is_ids(p) else {"prompt": p} for p in prompts[:COUNTED_PROMPTS]]


def _responses_messages(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A responses body's input as chat messages (input_text → text, input_image → image_url),
    for counting only."""
    messages: list[dict[str, Any]] = []
    if isinstance(doc.get("instructions"), str):
        messages.append({"role": "system", "content": doc["instructions"]})
    items = doc.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items or []:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, list):
            content = [_chat_part(p) for p in content]
        messages.append({"role": item.get("role", "user"), "content": content})
    return messages


def _chat_part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part
    if part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if part.get("type") == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url")}}
    return part
