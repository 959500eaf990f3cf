"""Counts the whole pod sees at once: requests in flight per route, for ``limits``.

A limit on concurrent requests is a limit on the pod, not on one worker: the supervisor maps one
small file in ``/dev/shm`` (a table of int64, a row per route slot, a column per worker), each
worker writes only its own column and reads the row's sum. Entering adds first and checks the
sum after, so two workers racing for the last place both see the other: at worst both refuse
(never both admit past the limit). A worker that dies has its column zeroed by the supervisor
before it is restarted. Outside a pod, a plain integer.

A route's row is a hash of its name (65,536 rows): two routes of one config on one row would
share a count; it is checked when the limits are built, and said in a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("mmguard.pod")

COUNTERS_ENV = "MMGUARD_POD_COUNTERS"
SLOTS = 1 << 16


def create(path: Path, workers: int) -> np.memmap[Any, np.dtype[np.int64]]:
    """The supervisor's table (zeros; sparse on tmpfs: only touched pages take memory)."""
    with open(path, "wb") as f:
        f.truncate(SLOTS * workers * 8)
    return np.memmap(path, dtype=np.int64, mode="r+", shape=(SLOTS, workers))


def zero_column(table: np.memmap[Any, np.dtype[np.int64]], index: int) -> None:
    table[:, index] = 0


class InFlight:
    """One route's requests in flight: this worker's, and the pod's."""

    def __init__(self, route: str) -> None:
        self.route = route
        self._local = 0
        self._row: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._index = 0
        table = _table()
        if table is not None:
            slot = _slot(route)
            other = _ROWS.setdefault(slot, route)
            if other != route:
                log.warning("limits: routes %r and %r share one in-flight count of the pod "
                            "(hash row %d); rename one to count them apart", other, route, slot)
            self._row = table[slot]
            self._index = _TABLE_INDEX[0]

    def enter(self) -> int:
        """Count this request in; the pod's requests in flight on the route, this one included."""
        return self.add(1)

    def leave(self) -> None:
        self.add(-1)

    def add(self, n: int) -> int:
        """Add ``n`` (a count or an amount, e.g. bytes held) to this worker's share; the pod's
        total after it."""
        self._local += n
        row = self._row
        if row is None:
            return self._local
        row[self._index] = self._local
        return int(row.sum())


_ROWS: dict[int, str] = {}
_TABLE: list[np.memmap[Any, np.dtype[np.int64]]] = []
_TABLE_INDEX = [0]


def _slot(route: str) -> int:
    digest = hashlib.blake2b(route.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SLOTS


def _table() -> np.memmap[Any, np.dtype[np.int64]] | None:
    """A pod worker's view of the supervisor's table (None outside a pod)."""
    if _TABLE:
        return _TABLE[0]
    path = os.environ.get(COUNTERS_ENV)
    if not path:
        return None
    from proxy.pod.state import POD

    if not POD.is_worker:
        return None
    _TABLE.append(np.memmap(path, dtype=np.int64, mode="r+", shape=(SLOTS, POD.workers)))
    _TABLE_INDEX[0] = POD.index
    return _TABLE[0]
