"""Server-sent events split as the spec says, from chunks as they arrive.

The HTML standard's event stream ends a line with CRLF, LF or CR, and an event with a blank
line: so ``\\n\\n``, ``\\r\\n\\r\\n`` and ``\\r\\r`` (and their mixtures) all end an event.
Events are handed on with LF line ends (what every client reads); a CR at the end of a chunk
waits for the next one, which may start with the LF of the same CRLF.
"""

from __future__ import annotations


class SseSplitter:
    """``feed(chunk)`` → the complete events so far, each ending in a blank line."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        held = b""
        if b"\r" in data:
            if data.endswith(b"\r"):
                data, held = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n\n" not in data:
            self._pending = data + held
            return []
        *events, rest = data.split(b"\n\n")
        self._pending = rest + held
        return [e + b"\n\n" for e in events if e.strip()]

    def end(self) -> list[bytes]:
        """The stream ended: a CR held back was a line end after all."""
        if not self._pending.endswith(b"\r"):
            return []
        pending, self._pending = self._pending[:-1] + b"\n", b""
        return self.feed(pending)

    @property
    def pending(self) -> bytes:
        """What has come since the last complete event (a stream that ends here was cut)."""
        return self._pending
