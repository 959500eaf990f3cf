"""What a client may make a model server fetch: strict URL parsing and the allow-list.

vLLM fetches ``http(s)`` image, audio and video URLs named in a request. mmguard refuses every
remote URL whose host is not allow-listed, and parses the rest strictly so that mmguard and the
backend can never read a different host out of the same string: a URL with a backslash, a
control character, a space, non-ASCII text or userinfo (``user@``) is refused, and what is sent
on is the URL as mmguard understood it, written out again (``SafeUrl.text``), never the raw one.
(urllib3, which vLLM uses, ends the host at ``\\``; Python's ``urlsplit`` does not.)

An allow-list entry is ``host`` or ``host:port`` (IPv6 as ``[::1]:port``); a bare host allows the
scheme's default port only (80 for http, 443 for https). One rule for names and literals: an
entry is a host and a port; an IP literal entry allows that address on that port only, also
when a name resolves to it (the fetcher checks resolved addresses with their port).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.errors import ErrorKind, ProxyError

DEFAULT_PORTS = {"http": 80, "https": 443}
_UNSAFE_CHARS = re.compile(r"[\x00-\x20\x7f\\]")  # control characters, space and backslash
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


def refused(message: str, param: str | None) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message, param=param)


def canonical_host(host: str) -> str:
    """A host as mmguard compares it: lower case, no trailing dot, IP literals in their canonical
    form; raises ``ValueError`` for anything a resolver might read as another host (numeric forms
    such as ``2130706433`` or ``0x7f.1``, ``%`` zone ids, characters outside a DNS name)."""
    host = host.lower().removesuffix(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        if "%" in host:
            raise ValueError("an IPv6 zone id is not allowed")
        return str(ipaddress.IPv6Address(host))
    if not _HOST_NAME.fullmatch(host):
        raise ValueError("not a DNS name or IP address")
    last = host.rsplit(".", 1)[-1]
    if last.isdigit() or last.startswith("0x"):
        # the C resolver reads "127.1", "0x7f.0.0.1" and "2130706433" as addresses: only the
        # canonical dotted quad is accepted, so every reader sees the same address
        return str(ipaddress.IPv4Address(host))
    return host


def url_host(host: str) -> str:
    """The host as written in a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class SafeUrl:
    scheme: str
    host: str  # canonical_host()
    port: int  # the effective port (the scheme's default when the URL names none)
    path: str  # path and query, as sent

    @property
    def text(self) -> str:
        """The URL written out again from what mmguard parsed: this is what the backend gets."""
        port = "" if self.port == DEFAULT_PORTS[self.scheme] else f":{self.port}"
        return f"{self.scheme}://{url_host(self.host)}{port}{self.path}"

    @property
    def authority(self) -> str:
        return f"{url_host(self.host)}:{self.port}"


def parse_url(raw: str, param: str) -> SafeUrl:
    """An http(s) URL that every parser reads the same way, or a 400 naming ``param``."""
    shown = raw if len(raw) <= 200 else raw[:200] + "…"
    if not raw.isascii() or _UNSAFE_CHARS.search(raw):
        raise refused(f"{param}: the URL {shown!r} has a backslash, a space, a control or a "
                      "non-ASCII character; mmguard refuses such URLs (parsers disagree on "
                      "them); percent-encode them", param)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise refused(f"{param}: not a valid URL ({exc}): {shown!r}", param) from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise refused(f"{param}: the URL scheme {parts.scheme!r} is refused; use http(s) from "
                      "an allow-listed host, or send the media inline as a data: URL", param)
    if "@" in parts.netloc:
        raise refused(f"{param}: a URL with userinfo ('…@host') is refused: {shown!r}", param)
    try:
        host = canonical_host(parts.hostname or "")
    except ValueError as exc:
        raise refused(f"{param}: the URL's host {parts.hostname!r} is refused: {exc}",
                      param) from None
    path = parts.path or "/"
    if not path.startswith("/"):
        raise refused(f"{param}: not a valid URL: {shown!r}", param)
    if parts.query:
        path += "?" + parts.query
    return SafeUrl(scheme, host, port or DEFAULT_PORTS[scheme], path)


@dataclass(frozen=True)
class AllowEntry:
    host: str
    port: int | None  # None: the scheme's default port

    @property
    def text(self) -> str:
        return url_host(self.host) + ("" if self.port is None else f":{self.port}")


def parse_allow_entry(text: str) -> AllowEntry:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; raises ``ValueError`` with the reason."""
    text = text.strip()
    if not text or "/" in text or "@" in text or _UNSAFE_CHARS.search(text):
        raise ValueError(f"{text!r} is not host or host:port")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":") if rest else None
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r} is not [ipv6] or [ipv6]:port")
    elif text.count(":") > 1:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:8080")
    else:
        host, sep, port_text_or_empty = text.partition(":")
        port_text = port_text_or_empty if sep else None
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
        port = int(port_text)
    try:
        return AllowEntry(canonical_host(host), port)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None


@dataclass(frozen=True)
class HostAllowList:
    entries: frozenset[AllowEntry]

    @classmethod
    def of(cls, entries: tuple[str, ...] | frozenset[str]) -> HostAllowList:
        return cls(frozenset(parse_allow_entry(e) for e in entries))

    def allows(self, url: SafeUrl) -> bool:
        if AllowEntry(url.host, url.port) in self.entries:
            return True
        return (url.port == DEFAULT_PORTS[url.scheme]
                and AllowEntry(url.host, None) in self.entries)

    def literal_endpoints(self) -> frozenset[tuple[str, int]]:
        """(address, port) of each entry that is an IP address: naming one allows connecting
        to that address on that port only (a bare address: ports 80 and 443, as for a name)."""
        out: set[tuple[str, int]] = set()
        for e in self.entries:
            try:
                address = str(ipaddress.ip_address(e.host))
            except ValueError:
                continue
            ports = DEFAULT_PORTS.values() if e.port is None else (e.port,)
            out.update((address, port) for port in ports)
        return frozenset(out)

    def check(self, raw: str, param: str) -> SafeUrl:
        url = parse_url(raw, param)
        if not self.allows(url):
            raise refused(f"{param}: remote media URLs are refused by mmguard ({url.authority} "
                          "is not on openai.image_url_allow_hosts); send the media inline as a "
                          "data: URL", param)
        return url
