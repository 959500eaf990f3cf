"""Each client's memory across its unary requests, where a listener says who the client is.

A gRPC stream is one client's, so its requests share one ``StreamMemory`` (the gRPC front makes
it). Unary requests carry no such tie: behind a gateway one keep-alive connection carries many
clients' requests. Only where the operator names a header that a trusted gateway sets on every
request (``listeners.*.client_header``) does the runtime give every unary call of one client the
same memory: what a filter kept from the client's earlier requests (``quality``'s residue: the
page sent before). Nothing else links two requests.

Bounded: at most ``MAX_CLIENTS`` clients per process, the least recently seen going first, and a
client unseen for ``IDLE_S`` is forgotten; a memory forgotten is closed, which gives back what
its entries hold of a process-wide budget (``filters.quality.residue.STREAMS``). Per process:
with several workers, a client's requests reach the memory of the worker that serves them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

from proxy.call import STREAM_MEMORY, Call, StreamMemory
from proxy.clock import Clock

MAX_CLIENTS = 1024
IDLE_S = 300.0


class ClientMemories:
    def __init__(self, headers: Mapping[str, str | None], clock: Clock,
                 max_clients: int = MAX_CLIENTS, idle_s: float = IDLE_S) -> None:
        self.headers = {front: h for front, h in headers.items() if h}
        """Front (grpc, http, openai) → the header that names the client there."""
        self.clock = clock
        self.max_clients = max_clients
        self.idle_s = idle_s
        self._seen: OrderedDict[bytes, tuple[StreamMemory, float]] = OrderedDict()

    def attach(self, call: Call) -> None:
        """Give ``call`` its client's memory, where its listener names the client; a stream's
        call keeps its stream's."""
        header = self.headers.get(call.front)
        if header is None or STREAM_MEMORY in call.state:
            return
        name = call.headers.get(header)
        if not name:
            return
        # Kept by a digest: a name is as long as the listener's header limit lets it be.
        client = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=16).digest()
        now = self.clock.monotonic()
        self._forget(now)
        found = self._seen.pop(client, None)
        memory = found[0] if found is not None else StreamMemory("the client")
        self._seen[client] = (memory, now)
        while len(self._seen) > self.max_clients:
            self._seen.popitem(last=False)[1][0].close()
        call.state[STREAM_MEMORY] = memory

    def _forget(self, now: float) -> None:
        """Close the memories of clients unseen for ``idle_s`` (the oldest come first)."""
        while self._seen:
            memory, seen = next(iter(self._seen.values()))
            if now - seen < self.idle_s:
                return
            self._seen.popitem(last=False)
            memory.close()

    def close(self) -> None:
        """Forget every client (the runtime is replaced or stops)."""
        seen, self._seen = self._seen, OrderedDict()
        for memory, _ in seen.values():
            memory.close()

    def __len__(self) -> int:
        return len(self._seen)
