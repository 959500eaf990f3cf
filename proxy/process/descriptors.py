"""Connection caps that fit the process's open-files limit.

Guards against caps that the descriptor table cannot honour: with the common hard limit of
1024 open files and the old fixed defaults (1000 HTTP + 1000 gRPC + 64 admin connections),
1100 slow connections exhausted the table before any cap was reached, and ``accept`` failed
for everyone: good requests were reset. A cap only protects good clients while it is below
the point where descriptors run out, so that a new connection can still be accepted and then
evict an idle one.

What MUST hold:
- At start the soft ``RLIMIT_NOFILE`` is raised to the hard limit (``proxy.cli.main``).
- A listener whose ``max_connections`` is absent gets a cap derived from that limit: a reserve
  is kept for everything else a process opens (backend connections, the fetcher's, shared
  memory regions, model files, logs): a quarter of the limit, at least 128; the admin listener
  gets a sixteenth of the rest (at most 64); HTTP and gRPC share what remains (at most 1000
  each). With 1024 open files: reserve 256, admin 48, HTTP 360, gRPC 360.
- A cap the config sets is kept as set; when the caps together pass what the limit leaves,
  a warning names them and the limit (the operator chose; mmguard says what will happen).
- The HTTP and admin listeners' accept queue (``listen(2)``'s backlog) is the kernel's
  ``net.core.somaxconn`` unless the config sets ``backlog``, as Envoy and gRPC core do:
  aiohttp's 128 overflowed when a burst of connections met a busy loop, and the kernel drops a
  connection attempt at a full queue; the client's retry waits a whole second.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from proxy.config.listeners import Listeners

log = logging.getLogger("mmguard.listeners")

RESERVE_MIN = 128
CEILING = {"http": 1000, "grpc": 1000, "admin": 64}
"""The derived caps never go above these (the former fixed defaults)."""


def open_files_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` now (after ``raise_open_files_limit``); 1 << 20 where
    unlimited or unknown."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return 1 << 20
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def raise_open_files_limit() -> tuple[int, int] | None:
    """The soft limit up to the hard one; (soft, hard) after it, None where not possible."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                        else max(soft, 65536), hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return None  # not on this platform, or not allowed: the soft limit stays


SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def accept_backlog(configured: int | None = None) -> int:
    """A listener's ``listen(2)`` backlog: ``configured``, else the kernel's
    ``net.core.somaxconn`` (the most it allows), else Python's ``socket.SOMAXCONN``."""
    if configured is not None:
        return configured
    try:
        return max(1, int(SOMAXCONN.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return socket.SOMAXCONN


@dataclass(frozen=True)
class ConnectionCaps:
    http: int
    grpc: int
    admin: int
    nofile: int
    budget: int
    """Descriptors the limit leaves for client connections (the limit less the reserve)."""

    def of(self, listener: str) -> int:
        return int(getattr(self, listener))


def connection_caps(listeners: Listeners, nofile: int | None = None) -> ConnectionCaps:
    """Each listener's ``max_connections``: as configured, or derived from ``nofile``."""
    nofile = open_files_limit() if nofile is None else nofile
    budget = max(3, nofile - max(RESERVE_MIN, nofile // 4))
    admin = listeners.admin.max_connections or max(1, min(CEILING["admin"], budget // 16))
    share = max(1, (budget - admin) // 2)
    http = listeners.http.max_connections or min(CEILING["http"], share)
    grpc = listeners.grpc.max_connections or min(CEILING["grpc"], share)
    caps = ConnectionCaps(http, grpc, admin, nofile, budget)
    if http + grpc + admin > budget:
        log.warning("listeners: max_connections http %d + grpc %d + admin %d pass the %d "
                    "descriptors the open-files limit (%d) leaves for clients; past that, new "
                    "connections fail at accept instead of evicting idle ones (lower them or "
                    "raise the limit; docs/security.md, Budgets)", http, grpc, admin, budget,
                    nofile)
    return caps
