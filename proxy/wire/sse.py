"""Server-sent events split as the spec says, from chunks as they arrive.

The HTML standard's event stream ends a line with CRLF, LF or CR, and an event with a blank
line: so ``\\n\\n``, ``\\r\\n\\r\\n`` and ``\\r\\r`` (and their mixtures) all end an event.
Events are handed on with LF line ends (what every client reads); a CR at the end of a chunk
waits for the next one, which may start with the LF of the same CRLF.
"""

from __future__ import annotations


class SseEventTooLarge(ValueError):
    """An event that had not ended after ``limit`` bytes (the stream is broken off)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"a server-sent event of more than {limit} bytes")
        self.limit = limit


class SseSplitter:
    """``feed(chunk)`` → the complete events so far, each ending in a blank line. An event
    still open is held in pieces (each byte copied once, however many reads it spans). An
    event of more than ``limit`` bytes, open or complete, is ``SseEventTooLarge``: raised at
    once, or, when complete events came before it in the same chunk, by the next ``feed`` or
    ``end`` (those events are handed on first)."""

    __slots__ = ("_held", "_parts", "_refused", "_size", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self._parts: list[bytes] = []  # the open event, line ends already made LF
        self._size = 0
        self._held = b""  # a CR that ended the last chunk: CRLF's first half, or a line end
        self._refused = False
        self.limit = limit

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._refused:
            raise SseEventTooLarge(self.limit or 0)
        data, self._held = self._held + chunk, b""
        if b"\r" in data:
            if data.endswith(b"\r"):
                data, self._held = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        ends = b"\n\n" in data or (
            self._parts and self._parts[-1].endswith(b"\n") and data.startswith(b"\n"))
        if not ends:
            if data:
                self._parts.append(data)
                self._size += len(data)
                if self.limit is not None and self._size > self.limit:
                    self._refuse([])
            return []
        if self._parts:
            self._parts.append(data)
            data = b"".join(self._parts)
        *events, rest = data.split(b"\n\n")
        self._parts, self._size = ([rest], len(rest)) if rest else ([], 0)
        over = self.limit is not None and self._size > self.limit
        if self.limit is not None and len(data) > self.limit:
            big = next((i for i, e in enumerate(events) if len(e) > self.limit), None)
            if big is not None:  # one that came whole in a large chunk
                events, over = events[:big], True
        done = [e + b"\n\n" for e in events if e.strip()]
        if over:
            self._refuse(done)
        return done

    def _refuse(self, done: list[bytes]) -> None:
        """Refuse the oversized event: now, or, when ``done`` events precede it, at the next
        ``feed`` or ``end`` (they are handed on first)."""
        self._parts, self._size, self._refused = [], 0, True
        if not done:
            raise SseEventTooLarge(self.limit or 0)

    def end(self) -> list[bytes]:
        """The stream ended: a CR held back was a line end after all."""
        if self._refused:
            raise SseEventTooLarge(self.limit or 0)
        if not self._held:
            return []
        self._held = b""
        return self.feed(b"\n")

    @property
    def pending(self) -> bytes:
        """What has come since the last complete event (a stream that ends here was cut)."""
        return b"".join(self._parts) + self._held
