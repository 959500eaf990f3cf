"""Who is on the other end of a connection: the peer's address and, on loopback, its uid (from
the kernel's socket diagnostics), so a client can only hand mmguard regions it owns."""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("mmguard.shm")

Peer = tuple[str, int]
"""A socket address: (host, port)."""


@dataclass(frozen=True, slots=True)
class Connection:
    """A client's connection: its address, and mmguard's end (host "" where the listener does
    not know it: then the usual loopback addresses are tried)."""

    peer: Peer | None
    local: Peer = ("", 0)


UidLookup = Callable[[Peer, Peer], int | None]


def grpc_peer(peer: str | None) -> Peer | None:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` (grpc.aio's ``context.peer()``) → address."""
    if not peer:
        return None
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    host, _, port = rest.rpartition(":")
    if scheme not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def peer_uid(peer: Peer, local: Peer) -> int | None:
    """The uid owning the client's end (``peer``) of a loopback TCP connection to ``local``,
    asked of the kernel (sock_diag: one exact lookup, not a scan of every socket). ``local``'s
    host may be "" when the listener does not know it: then the usual loopback addresses are
    tried."""
    try:
        ip = _unmapped(ipaddress.ip_address(peer[0].split("%", 1)[0]))
    except ValueError:
        return None
    candidates = [local[0]] if local[0] else [str(ip), "127.0.0.1", "::1"]
    for host in candidates:
        try:
            there = _unmapped(ipaddress.ip_address(host.split("%", 1)[0]))
        except ValueError:
            continue
        if there.version == ip.version:
            uid = _diag_uid(ip, peer[1], there, local[1])
            if uid is not None:
                return uid
    return None


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> (
        ipaddress.IPv4Address | ipaddress.IPv6Address):
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR = 4, 20, 2
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, inet_diag_msg's 4 bytes and sockid, 3 u32s, then uid


def _diag_uid(src: ipaddress.IPv4Address | ipaddress.IPv6Address, sport: int,
              dst: ipaddress.IPv4Address | ipaddress.IPv6Address, dport: int) -> int | None:
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    sockid = (struct.pack("!HH", sport, dport) + src.packed.ljust(16, b"\0")
              + dst.packed.ljust(16, b"\0") + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, 1, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(header + request, (0, 0))
            answer = nl.recv(4096)
    except OSError as exc:
        log.debug("sock_diag lookup failed: %s", exc)
        return None
    if len(answer) < _UID_AT + 4:
        return None
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind != _SOCK_DIAG_BY_FAMILY:  # _NLMSG_ERROR: no such connection
        return None
    return int(struct.unpack_from("=I", answer, _UID_AT)[0])
