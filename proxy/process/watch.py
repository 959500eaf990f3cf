"""Reload without ``kill``: poll the config file and the files it names for a change.

A Kubernetes ConfigMap or Secret volume updates by swapping the ``..data`` symlink to a new
directory, so the file's path stays and its inode (seen through the link) changes; a file
rewritten in place changes its mtime or size. Each poll is one ``stat`` per file, in a worker
thread (a hung network volume must not hold the event loop), every ``watch_config_s``.

What MUST hold: a change reloads once (as SIGHUP does), also when the reload is rejected (the
same broken file is not retried every poll; the next change is); a file that disappears counts
as a change (the reload then says what is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from proxy.config.model import Config

log = logging.getLogger("mmguard.watch")

Fingerprint = tuple[int, int, int, int] | None
SETTLE_S = 0.2
"""After a change is seen, wait this long and look again: a writer may be mid-write."""


def watched_files(config_path: Path | None, config: Config) -> list[Path]:
    """The config file and every file it names that a reload would read anew: TLS files of
    listeners and backends, and the canary membership secret."""
    paths = [] if config_path is None else [config_path]
    for tls in (config.listeners.http.tls, config.listeners.grpc.tls, config.listeners.admin.tls):
        if tls is not None:
            paths += [tls.cert_file, tls.key_file]
            paths += [tls.client_ca_file] if tls.client_ca_file is not None else []
    for backend in config.backends:
        client = getattr(backend, "tls", None)
        if client is not None:
            paths += [p for p in (client.ca_file, client.cert_file, client.key_file)
                      if p is not None]
    if config.canary.secret_file is not None:
        paths.append(config.canary.secret_file)
    return paths


def fingerprints(paths: list[Path]) -> dict[str, Fingerprint]:
    found: dict[str, Fingerprint] = {}
    for path in paths:
        try:
            st = os.stat(path)  # follows the symlinks: a swapped ..data shows a new inode
        except OSError:
            found[str(path)] = None
        else:
            found[str(path)] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    return found


class FileWatch:
    """Calls ``on_change(paths)`` when any of ``paths()`` changes, polling every ``interval_s``."""

    def __init__(self, paths: Callable[[], list[Path]], interval_s: float,
                 on_change: Callable[[list[str]], Awaitable[None]]) -> None:
        self.paths = paths
        self.interval_s = interval_s
        self.on_change = on_change
        self._seen: dict[str, Fingerprint] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._seen = fingerprints(self.paths())
        self._task = asyncio.create_task(self._run(), name="config watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._poll()
            except Exception as exc:  # the watch keeps going; SIGHUP still works
                log.error("config watch: %s: %s", type(exc).__name__, exc)

    async def _poll(self) -> None:
        now = await asyncio.to_thread(fingerprints, self.paths())
        if now == self._seen:
            return
        await asyncio.sleep(SETTLE_S)
        now = await asyncio.to_thread(fingerprints, self.paths())
        changed = sorted(p for p in now.keys() | self._seen.keys()
                         if now.get(p) != self._seen.get(p))
        self._seen = now
        if changed:
            await self.on_change(changed)
        # The reload may name other files now; what they are at this point is the baseline.
        self._seen = await asyncio.to_thread(fingerprints, self.paths())
