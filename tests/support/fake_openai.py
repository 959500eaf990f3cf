"""The routes every hand-written OpenAI-compatible server of the tests needs (``/health``,
``/version``, ``/v1/models`` for one model) around its own ``/v1/chat/completions``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Chat = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_app(model: str, chat: Chat, client_max_size: int = 1024 ** 2) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "fake"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "root": model, "max_model_len": 4096}]})

    app = web.Application(client_max_size=client_max_size)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app
