"""The lean backend client (``proxy/backends/http_client.py``) on real loopback sockets.

What a real Triton does not do on cue — close an idle keep-alive connection, drop a request it
read, never answer, answer in chunks or with ``Connection: close`` — a scripted HTTP/1.1 server
does here, over the real wire: each connection reads whole requests (head, then
Content-Length bytes) and does what the next entry of its script says.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from proxy.backends.http_client import (
    MAX_HEAD,
    AnswerTooLarge,
    BackendDisconnected,
    BackendProtocolError,
    HttpPool,
    Streamed,
)


class Scripted:
    """A loopback HTTP/1.1 server; ``script`` is consumed one entry per request received."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self.client_closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def base(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def closed_by_client_within(self, seconds: float) -> int:
        """How many connections the client closed, once one has (or ``seconds`` passed)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.client_closed.wait(), seconds)
        return self.closed_by_client

    def _closed_by_client(self) -> None:
        self.closed_by_client += 1
        self.client_closed.set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self._closed_by_client()
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                step = self.script.pop(0) if self.script else "ok"
                if step == "drop":  # read the request, answer nothing, close
                    return
                if step == "hang":  # read the request, never answer
                    await reader.read()  # until the client closes
                    self._closed_by_client()
                    return
                if step == "slow":
                    await asyncio.sleep(0.2)
                if step in ("stream", "stream-forever"):  # an SSE-like answer, read by read
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(3 if step == "stream" else 10_000):
                        writer.write(b"6\r\nevent%d\r\n" % (i % 10))
                        await writer.drain()
                        await asyncio.sleep(0.02)
                        if writer.is_closing() or reader.at_eof():
                            break
                    if step == "stream-forever":
                        self._closed_by_client()
                        return
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                    continue
                if step == "stall":  # a streamed answer's first chunk, then silence
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"5\r\nfirst\r\n")
                    await writer.drain()
                    await reader.read()  # until the client closes
                    self._closed_by_client()
                    return
                if step == "endless-head":  # a status line, then one header without end
                    writer.write(b"HTTP/1.1 200 OK\r\nX-Long: ")
                    with contextlib.suppress(ConnectionError):
                        while not writer.is_closing() and not reader.at_eof():
                            writer.write(b"z" * 4096)
                            await writer.drain()
                    self._closed_by_client()
                    return
                if step == "big-declared":  # declares 10 MB, sends 1 KB, waits for the close
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\n"
                                 + b"x" * 1024)
                    await writer.drain()
                    await reader.read()
                    self._closed_by_client()
                    return
                if step in ("endless", "endless-500"):  # chunks of 64 KiB until the client closes
                    status = b"200 OK" if step == "endless" else b"500 Internal Server Error"
                    writer.write(b"HTTP/1.1 %s\r\nTransfer-Encoding: chunked\r\n\r\n" % status)
                    with contextlib.suppress(ConnectionError):
                        while not writer.is_closing() and not reader.at_eof():
                            writer.write(b"10000\r\n" + b"y" * 65536 + b"\r\n")
                            await writer.drain()
                    self._closed_by_client()
                    return
                if step == "to-close":  # neither sized nor chunked: the body ends at the close
                    writer.write(b"HTTP/1.1 200 OK\r\nX-Answer: eof\r\n\r\nuntil " + body)
                    await writer.drain()
                    return
                if step == "chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                 b"X-Answer: chunked\r\n\r\n"
                                 b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
                else:
                    payload = b"echo:" + body
                    close = step in ("close", "ok-then-close")
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s"
                                 b"X-Answer: one\r\nX-Answer: two\r\n\r\n%s"
                                 % (len(payload), b"Connection: close\r\n" if step == "close"
                                    else b"", payload))
                    if close:
                        await writer.drain()
                        return  # "ok-then-close": closed without saying so (an idle timeout)
                await writer.drain()
        finally:
            self.open -= 1
            writer.close()


@asynccontextmanager
async def scripted(script: list[str]) -> AsyncIterator[Scripted]:
    s = Scripted(script)
    s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    try:
        yield s
    finally:
        s.server.close()


async def post(pool: HttpPool, body: bytes, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], bytes]:
    head = pool.head("POST", "/v2/models/m/infer", {"content-length": "999", **(headers or {})},
                     len(body))
    answer = await pool.request(head, (body[:3], memoryview(body)[3:]))
    return answer.status, dict(answer.headers), answer.body


async def test_keep_alive_reuses_one_connection_and_reads_the_first_of_repeated_headers() -> None:
    async with scripted([]) as s:
        pool = HttpPool(s.base, 4, True)
        for i in range(5):
            status, headers, body = await post(pool, b"x%d" % i, {"traceparent": "00-ab-cd-01"})
            assert (status, body) == (200, b"echo:x%d" % i)
            assert headers["x-answer"] == "one"
        assert s.connections == 1
        assert b"traceparent: 00-ab-cd-01\r\n" in s.requests[0]
        assert s.requests[0].lower().count(b"content-length:") == 1  # the body's, not "999"
        assert b"Content-Length: 2\r\n" in s.requests[0]
        assert s.requests[0].startswith(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1:")
        pool.close()


async def test_a_connection_the_backend_closed_while_idle_is_not_reused() -> None:
    async with scripted(["ok-then-close", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        assert (await post(pool, b"a"))[2] == b"echo:a"
        await asyncio.sleep(0.05)  # the close reaches the client: the connection is known gone
        assert (await post(pool, b"b"))[2] == b"echo:b"
        assert s.connections == 2
        pool.close()


async def test_a_request_dropped_on_a_reused_connection_is_an_error_and_is_not_repeated() -> None:
    # What an idle close racing the request looks like: the backend read it and closed without
    # a byte of answer. It may have run it: a sequence model must not see it twice.
    async with scripted(["ok", "drop", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        assert (await post(pool, b"a"))[2] == b"echo:a"
        with pytest.raises(BackendDisconnected, match="closed the connection before the end"):
            await post(pool, b"b")
        assert [r.endswith(b"b") for r in s.requests] == [False, True]
        assert (await post(pool, b"c"))[2] == b"echo:c"  # the broken connection is not reused
        assert s.connections == 2
        pool.close()


async def test_a_timed_out_call_closes_its_connection_and_the_next_call_opens_one() -> None:
    async with scripted(["hang", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await post(pool, b"a")
        assert await s.closed_by_client_within(2.0) == 1  # the late answer reaches no call
        assert (await post(pool, b"b"))[2] == b"echo:b"
        assert s.connections == 2
        pool.close()


async def test_chunked_and_connection_close_answers() -> None:
    async with scripted(["chunked", "close", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        status, headers, body = await post(pool, b"a")
        assert (status, body, headers["x-answer"]) == (200, b"hello world", "chunked")
        assert (await post(pool, b"b"))[2] == b"echo:b"  # same connection, then it closes
        assert (await post(pool, b"c"))[2] == b"echo:c"  # so a new one
        assert s.connections == 2
        pool.close()


async def test_an_answer_that_runs_to_the_close_is_read_whole_as_aiohttp_reads_it() -> None:
    async with scripted(["to-close", "to-close"]) as s:
        pool = HttpPool(s.base, 4, True)
        status, headers, body = await post(pool, b"a")
        assert (status, body, headers["x-answer"]) == (200, b"until a", "eof")
        streamed = await _stream(pool)  # streamed, on a new connection
        assert streamed.status == 200
        assert await streamed.body.read_all() == b"until x"
        streamed.release()
        assert s.connections == 2
        pool.close()


async def test_never_more_connections_than_the_pool_size() -> None:
    async with scripted(["slow"] * 8) as s:
        pool = HttpPool(s.base, 2, True)
        answers = await asyncio.gather(*(post(pool, b"%d" % i) for i in range(8)))
        assert sorted(a[2] for a in answers) == sorted(b"echo:%d" % i for i in range(8))
        assert s.most_open == 2
        pool.close()


@pytest.mark.parametrize("name, value", [("x-a", "v\r\nX-Injected: 1"), ("x-a", "v\nw"),
                                         ("x-a", "v\0"), ("x a", "v"), ("x:a", "v"),
                                         ("", "v"), ("x-\u00e9", "v")])
def test_a_header_that_cannot_be_one_line_is_refused_and_nothing_is_written(
        name: str, value: str) -> None:
    pool = HttpPool("http://127.0.0.1:9", 1, True)
    with pytest.raises(ValueError, match="cannot be sent to the backend"):
        pool.head("POST", "/", {name: value}, 0)


def test_the_host_header_and_tls_defaults_follow_the_url() -> None:
    pool = HttpPool("https://localhost:8443", 1, True)
    assert (pool.host, pool.port, pool.tls) == ("localhost", 8443, True)
    assert pool.head("GET", "/v2", {}, 0) == (b"GET /v2 HTTP/1.1\r\nHost: localhost:8443\r\n"
                                              b"Content-Length: 0\r\n\r\n")
    plain = HttpPool("http://127.0.0.1", 1, True)
    assert (plain.port, plain.tls, plain.host_header) == (80, False, "127.0.0.1")


async def _stream(pool: HttpPool) -> Streamed:
    return await pool.open_stream(pool.head("POST", "/v1/chat/completions", {}, 1), (b"x",))


async def test_a_streamed_answer_comes_read_by_read_and_its_connection_is_reused() -> None:
    async with scripted(["stream", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        streamed = await _stream(pool)
        reads = []
        ended = False
        while not ended:
            data, ended = await streamed.body.read()
            reads.append(data)
        streamed.release()
        assert streamed.status == 200
        assert b"".join(reads) == b"event0event1event2"
        assert len([r for r in reads if r]) == 3  # one item per read, not one at the end
        assert (await post(pool, b"b"))[2] == b"echo:b"
        assert s.connections == 1
        pool.close()


async def test_a_stream_left_before_its_end_closes_its_connection() -> None:
    # What makes vLLM stop generating for a client that went away.
    async with scripted(["stream-forever", "ok"]) as s:
        pool = HttpPool(s.base, 1, True)
        streamed = await _stream(pool)
        assert (await streamed.body.read())[0] == b"event0"
        streamed.release()
        assert (await post(pool, b"b"))[2] == b"echo:b"  # the pool's one slot was given back
        assert await s.closed_by_client_within(2.0) == 1
        assert s.connections == 2
        pool.close()


async def test_an_idle_connection_is_closed_after_the_idle_time() -> None:
    async with scripted([]) as s:
        pool = HttpPool(s.base, 4, True, idle_s=0.1)
        assert (await post(pool, b"a"))[2] == b"echo:a"
        assert await s.closed_by_client_within(2.0) == 1  # nobody asked: the pool let it go
        assert (await post(pool, b"b"))[2] == b"echo:b"
        assert s.connections == 2
        pool.close()


async def test_an_answer_declared_over_max_body_is_refused_unread_and_its_connection_closed(
        ) -> None:
    async with scripted(["big-declared", "ok"]) as s:
        pool = HttpPool(s.base, 4, True, max_body=4096)
        with pytest.raises(AnswerTooLarge) as err:
            async with asyncio.timeout(10):
                await post(pool, b"a")
        assert (err.value.size, err.value.limit) == (10_000_000, 4096)
        assert str(err.value) == "an answer of 10000000 bytes"
        assert await s.closed_by_client_within(5.0) == 1
        assert (await post(pool, b"b"))[2] == b"echo:b"  # a fresh connection
        assert s.connections == 2
        pool.close()


async def test_an_answer_without_end_is_cut_at_max_body_and_its_connection_closed() -> None:
    # Without the bound this call would read (and hold) until the deadline: 64 KiB a read.
    async with scripted(["endless"]) as s:
        pool = HttpPool(s.base, 4, True, max_body=1 << 20)
        with pytest.raises(AnswerTooLarge) as err:
            async with asyncio.timeout(10):
                await post(pool, b"a")
        assert (err.value.size, err.value.limit) == (None, 1 << 20)
        assert str(err.value) == "an answer of more than 1048576 bytes"
        assert await s.closed_by_client_within(5.0) == 1
        pool.close()


async def test_an_answer_of_exactly_max_body_bytes_is_taken_one_more_is_not() -> None:
    async with scripted(["ok", "ok"]) as s:
        pool = HttpPool(s.base, 4, True, max_body=len(b"echo:") + 10)
        assert (await post(pool, b"0123456789"))[2] == b"echo:0123456789"
        with pytest.raises(AnswerTooLarge):
            await post(pool, b"0123456789a")
        pool.close()


async def test_a_streamed_answers_error_body_is_read_whole_up_to_max_body() -> None:
    async with scripted(["endless-500"]) as s:
        pool = HttpPool(s.base, 4, True, max_body=1 << 20)
        streamed = await pool.open_stream(pool.head("POST", "/v1/chat/completions", {}, 2),
                                          (b"{}",))
        assert streamed.status == 500
        try:
            with pytest.raises(AnswerTooLarge, match="more than 1048576 bytes"):
                async with asyncio.timeout(10):
                    await streamed.body.read_all()
        finally:
            streamed.release()
        assert await s.closed_by_client_within(5.0) == 1  # not kept: its answer never ended
        pool.close()


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_head_without_end_is_refused_past_max_head_and_its_connection_closed(
        streaming: bool) -> None:
    # httptools holds a header value being read whole: without the bound, a backend that never
    # ends one grows mmguard's memory until the deadline.
    async with scripted(["endless-head", "ok"]) as s:
        pool = HttpPool(s.base, 4, True)
        call = (pool.open_stream(pool.head("POST", "/x", {}, 1), (b"a",)) if streaming
                else post(pool, b"a"))
        with pytest.raises(BackendProtocolError, match=f"still open after {MAX_HEAD} bytes"):
            async with asyncio.timeout(10):
                await call
        assert await s.closed_by_client_within(5.0) == 1
        assert (await post(pool, b"b"))[2] == b"echo:b"
        pool.close()


@asynccontextmanager
async def watched(pool: HttpPool, idle_s: float) -> AsyncIterator[Streamed]:
    """A streamed call watched for ``idle_s`` of silence, released at the end."""
    streamed = await pool.open_stream(pool.head("POST", "/x", {}, 1), (b"a",))
    streamed.body.watch_idle(idle_s)
    try:
        yield streamed
    finally:
        streamed.release()


async def test_a_watched_stream_that_goes_silent_fails_and_closes_its_connection() -> None:
    async with scripted(["stall"]) as s:
        pool = HttpPool(s.base, 4, True)
        async with watched(pool, 0.3) as streamed:
            assert await streamed.body.read() == (b"first", False)
            with pytest.raises(TimeoutError, match=r"nothing came for 0\.3 s"):
                async with asyncio.timeout(10):
                    await streamed.body.read()
        assert await s.closed_by_client_within(5.0) == 1
        pool.close()


async def test_a_reader_slower_than_the_idle_time_is_not_the_backends_silence() -> None:
    # 64 KiB chunks without end: past 1 MiB unread the socket is paused and nothing more
    # comes, because the reader has not taken what came; the watch must not take that pause
    # for the backend's silence.
    async with scripted(["endless"]) as s:
        pool = HttpPool(s.base, 4, True)
        async with watched(pool, 0.1) as streamed:
            await asyncio.sleep(0.6)
            got = 0
            while got < 4 << 20:  # well past the pause: reading resumes it, more comes
                data, ended = await streamed.body.read()
                assert not ended
                got += len(data)
        pool.close()


async def test_a_stalled_event_loop_is_not_the_backends_silence() -> None:
    # The backend (in its own thread, so it keeps going while this loop is blocked) sends its
    # second chunk 0.1 s after the first; this loop is blocked for 0.6 s meanwhile, past the
    # idle time. The loop polls its sockets before it runs the watch's overdue timer, so the
    # bytes that came during the stall count: a busy proxy is not a silent backend.
    listener = socket.create_server(("127.0.0.1", 0))

    def backend() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nfirst\r\n")
            time.sleep(0.1)
            conn.sendall(b"6\r\nsecond\r\n0\r\n\r\n")
            time.sleep(1.0)

    thread = threading.Thread(target=backend, daemon=True)
    thread.start()
    pool = HttpPool(f"http://127.0.0.1:{listener.getsockname()[1]}", 4, True)
    try:
        async with watched(pool, 0.3) as streamed:
            assert await streamed.body.read() == (b"first", False)
            time.sleep(0.6)  # noqa: ASYNC251 - the loop stalls past the idle time, on purpose
            assert await streamed.body.read() == (b"second", True)
    finally:
        pool.close()
        listener.close()


async def test_a_closed_pool_lets_a_stream_in_flight_end_then_closes_it_and_opens_no_more(
        ) -> None:
    """A reload retires a backend while an LLM answer still streams from it: the stream runs
    to its end, its connection is then closed (not kept), the idle ones are closed at once
    (``aclose`` returns when they are gone), and the closed pool opens no connection."""
    async with scripted(["ok", "stream"]) as s:
        pool = HttpPool(s.base, 2, True)
        assert (await post(pool, b"a"))[2] == b"echo:a"
        streaming = pool._idle[0]
        streamed = await _stream(pool)  # on the idle connection
        assert streamed._conn is streaming
        assert (await post(pool, b"b"))[2] == b"echo:b"  # on a second one, then idle
        idle = pool._idle[-1]
        assert idle is not streaming
        await pool.aclose()
        assert idle.lost, "an idle connection outlived aclose"
        reads = []
        while True:
            data, ended = await streamed.body.read()
            reads.append(data)
            if ended:
                break
        assert b"".join(reads) == b"event0event1event2", "the stream in flight was cut"
        streamed.release()
        assert streaming.lost and not pool._idle, "the stream's connection was kept after its end"
        assert await s.closed_by_client_within(2.0) >= 1
        with pytest.raises(ConnectionResetError, match="a config reload replaced it"):
            await post(pool, b"late")
