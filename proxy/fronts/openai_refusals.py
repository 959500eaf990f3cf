"""vLLM endpoints mmguard does not proxy, each answered with the reason instead of a bare 404;
and what a path or method no route serves gets on vLLM's paths: vLLM's own answer.

Two kinds: endpoints whose inputs mmguard's guards do not read (a client could send through them
what the proxied endpoints refuse: remote media, documents, batches the filters never see), and
endpoints that control or describe the model server's internals (never a client's business).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_urldispatcher import MatchInfoError

from proxy.errors import STATUS, ErrorKind
from proxy.wire import openai

_UNREAD = ("is not proxied by mmguard: its inputs are not read by mmguard's guards (content "
           "checks, remote-media rules, quality, shape guard)")
_SERVER = ("controls or describes the model server itself and is never exposed to clients "
           "through mmguard; use it on the vLLM server from a trusted host")

NOT_PROXIED: dict[str, tuple[ErrorKind, str]] = {
    **{path: (ErrorKind.UNIMPLEMENTED, f"{path} {_UNREAD}; {alt}") for path, alt in (
        ("/v1/messages", "use /v1/chat/completions"),
        ("/v1/messages/count_tokens", "use /tokenize with 'messages'"),
        ("/v1/chat/completions/batch", "send each conversation to /v1/chat/completions"),
        ("/v1/chat/completions/render", "use /tokenize with 'messages'"),
        ("/v1/completions/render", "use /tokenize"),
        ("/v1/systemone", "use /v1/chat/completions"),
        ("/generative_scoring", "use /v1/completions with logprobs"),
        ("/classify", "call vLLM directly from a trusted client"),
        ("/score", "call vLLM directly from a trusted client"),
        ("/v1/score", "call vLLM directly from a trusted client"),
        ("/rerank", "call vLLM directly from a trusted client"),
        ("/v1/rerank", "call vLLM directly from a trusted client"),
        ("/v2/rerank", "call vLLM directly from a trusted client"),
        ("/v2/embed", "use /v1/embeddings"),
        ("/v1/audio/transcriptions", "call vLLM directly from a trusted client"),
        ("/v1/audio/translations", "call vLLM directly from a trusted client"),
        ("/inference/v1/generate", "use /v1/completions with a token-id prompt"),
    )},
    **{path: (ErrorKind.PERMISSION_DENIED, f"{path} {_SERVER}") for path in (
        "/load", "/kv_event_sources", "/server_info", "/is_sleeping", "/sleep", "/wake_up",
        "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
        "/reset_encoder_cache", "/collective_rpc", "/start_profile", "/stop_profile",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/scale_elastic_ep",
        "/is_scaling_elastic_ep", "/pause", "/resume", "/is_paused", "/abort_requests",
        "/update_weights", "/weight_info", "/get_world_size", "/fault_tolerance/status",
        "/openapi.json", "/docs", "/redoc",
    )},
    "/metrics": (ErrorKind.NOT_FOUND, "mmguard's own metrics are on its admin listener at "
                 "/metrics; vLLM's are at the vLLM server's own /metrics (scrape it there)"),
}


def register_refusals(router: web.UrlDispatcher) -> None:
    for path, (kind, reason) in NOT_PROXIED.items():
        router.add_route("*", path, _refusal(kind, reason))


def _refusal(kind: ErrorKind, reason: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(openai.error_body(kind, reason),
                                 status=STATUS[kind].http,
                                 headers={"mmguard-error-origin": "mmguard"})
    return refuse


_VLLM_TOP = frozenset({openai.TOKENIZE, openai.DETOKENIZE, openai.POOLING, openai.INVOCATIONS,
                       "/health", "/ping", "/version", "/tokenizer_info"}
                      | {path for path in NOT_PROXIED if not path.startswith("/v1/")})


def speaks_vllm(path: str) -> bool:
    """Whether a path is vLLM's (``/v1/...`` and vLLM's own top-level endpoints): what no
    route serves there is answered as vLLM (FastAPI) answers it; elsewhere as Triton does."""
    path = path.rstrip("/")
    return path == "/v1" or path.startswith("/v1/") or path in _VLLM_TOP


async def vllm_miss(request: web.Request, status: int,
                    allowed: frozenset[str] = frozenset()) -> web.Response:
    """A vLLM path no route serves, as vLLM answers it: a method the path does not take is
    ``405 {"detail":"Method Not Allowed"}`` with ``Allow`` (HEAD included: vLLM's GET routes
    do not take it); an unknown path ``404 {"detail":"Not Found"}``, unless the same path with
    its trailing slash toggled is served: then a ``307`` there, as vLLM redirects it."""
    headers = {"mmguard-error-origin": "mmguard"}
    if status == 405:
        return web.json_response({"detail": "Method Not Allowed"}, status=405, dumps=compact,
                                 headers={**headers, "Allow": ", ".join(sorted(allowed))})
    path = request.path
    if path != "/":
        other = path[:-1] if path.endswith("/") else path + "/"
        match = await request.app.router.resolve(request.clone(rel_url=request.rel_url
                                                               .with_path(other)))
        if not isinstance(match, MatchInfoError) or match.http_exception.status == 405:
            location = request.url.with_path(other).with_query(request.query_string)
            return web.Response(status=307, headers={**headers, "Location": str(location)})
    return web.json_response({"detail": "Not Found"}, status=404, dumps=compact,
                             headers=headers)


def compact(doc: object) -> str:
    """JSON without spaces, as FastAPI (vLLM) and Triton write their error bodies."""
    return json.dumps(doc, separators=(",", ":"))
