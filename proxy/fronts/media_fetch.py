"""Safe mode for remote images (``openai.remote_images: fetch``): mmguard fetches an allow-listed
image itself and sends it to the backend inline, as a ``data:`` URL, so the model server never
fetches anything a client named.

Why not let vLLM fetch it: vLLM follows redirects (an allow-listed host that redirects elsewhere
is followed) and resolves names itself (a name that resolves to another address at fetch time —
DNS rebinding — is fetched). Here every hop is checked:

- each URL, the first and every redirect target, is parsed strictly and must be allow-listed;
- the name is resolved once, every address is checked, and the connection goes to a checked
  address (the check runs inside the connector's resolver, so nothing can change in between):
  an address passes when the allow-list names it, it is inside ``fetch.allow_networks``, or it
  is a globally routable address;
- at most ``fetch.max_redirects`` hops, ``fetch.timeout_s`` for the whole fetch,
  ``fetch.max_bytes`` read (counted as the body arrives), and a ``Content-Type`` from
  ``fetch.content_types``. No client header, cookie or proxy setting travels with the fetch.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import socket
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from proxy.call import Call
from proxy.config.model import RemoteImageFetch
from proxy.errors import ErrorKind, ProxyError
from proxy.wire.media_urls import HostAllowList, SafeUrl, parse_url, refused
from proxy.wire.openai_parts import UrlSite, url_sites

log = logging.getLogger("mmguard.media_fetch")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressRefused(aiohttp.ClientError):
    """A name resolved only to addresses the rule does not allow."""


class CheckedResolver(AbstractResolver):
    """Resolves a name and hands the connector only the addresses that pass the rule."""

    def __init__(self, named: frozenset[str], networks: tuple[IpNetwork, ...]) -> None:
        self.named = named
        self.networks = networks

    def allows(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return (str(ip) in self.named or any(ip in net for net in self.networks)
                or ip.is_global)

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, family=family)
        out: list[ResolveResult] = []
        seen: list[str] = []
        for fam, _, proto, _, sockaddr in infos:
            address = str(sockaddr[0])
            seen.append(address)
            if self.allows(address):
                out.append({"hostname": host, "host": address, "port": int(sockaddr[1]),
                            "family": fam, "proto": proto, "flags": socket.AI_NUMERICHOST})
        if not out:
            raise AddressRefused(f"{host} resolved to {sorted(set(seen))}: none is allow-listed, "
                                 "in openai.fetch.allow_networks, or a global address")
        return out

    async def close(self) -> None:
        return None


class ImageFetcher:
    def __init__(self, cfg: RemoteImageFetch, allow: HostAllowList) -> None:
        self.cfg = cfg
        self.allow = allow
        self.resolver = CheckedResolver(
            allow.literal_addresses(),
            tuple(ipaddress.ip_network(n, strict=False) for n in cfg.allow_networks))
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=self.resolver, use_dns_cache=False,
                                             limit=32, force_close=True)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def inline(self, call: Call, found: list[UrlSite] | None = None) -> int:
        """Fetch every remote image of the call and put it in the document as a data: URL;
        returns how many were fetched. The call is re-encoded when any was. ``found``: the
        remote images already found in the document (``apply_url_policy``'s walk)."""
        assert call.document is not None
        sites = (found if found is not None else
                 [s for s in url_sites(call.document) if s.remote and s.image])
        if not sites:
            return 0
        try:
            async with asyncio.TaskGroup() as group:  # one refusal cancels the other fetches
                for site in sites:
                    group.create_task(self._inline_one(site))
        except BaseExceptionGroup as failed:
            first = failed.exceptions[0]
            raise first if isinstance(first, ProxyError) else failed from None
        call.wire = None
        return len(sites)

    async def _inline_one(self, site: UrlSite) -> None:
        url = self.allow.check(site.url, site.where)
        ctype, data = await self.fetch(url, site.where)
        site.holder[site.key] = f"data:{ctype};base64,{base64.b64encode(data).decode()}"

    async def fetch(self, url: SafeUrl, param: str) -> tuple[str, bytes]:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self._follow(url, param)
        except TimeoutError:
            raise refused(f"{param}: fetching {url.text} took longer than "
                          f"{self.cfg.timeout_s} s (openai.fetch.timeout_s)", param) from None
        except AddressRefused as exc:
            raise refused(f"{param}: {exc}; mmguard did not fetch {url.text}", param) from None
        except aiohttp.ClientError as exc:
            raise refused(f"{param}: could not fetch {url.text}: {type(exc).__name__}: {exc}",
                          param) from None

    async def _follow(self, url: SafeUrl, param: str) -> tuple[str, bytes]:
        for _hop in range(self.cfg.max_redirects + 1):
            async with self.session().get(url.text, allow_redirects=False, headers={
                    "Accept": ", ".join(self.cfg.content_types), "User-Agent": "mmguard"}) as r:
                if r.status in _REDIRECTS and "Location" in r.headers:
                    target = urljoin(url.text, r.headers["Location"])
                    nxt = parse_url(target, param)
                    if not self.allow.allows(nxt):
                        log.debug("%s: %s redirects to %s, which is not allow-listed",
                                  param, url.text, nxt.authority)
                        raise refused(f"{param}: {url.text} redirects to {nxt.authority}, which "
                                      "is not on openai.image_url_allow_hosts; mmguard did not "
                                      "follow it", param)
                    url = nxt
                    continue
                if r.status != 200:
                    raise refused(f"{param}: {url.text} answered HTTP {r.status}", param)
                return self._content_type(r, url, param), await self._read(r, url, param)
        raise refused(f"{param}: {url.text} redirected more than {self.cfg.max_redirects} times "
                      "(openai.fetch.max_redirects)", param)

    def _content_type(self, r: aiohttp.ClientResponse, url: SafeUrl, param: str) -> str:
        ctype = r.content_type.lower()
        if ctype not in self.cfg.content_types:
            raise refused(f"{param}: {url.text} sent Content-Type {ctype!r}; mmguard takes "
                          f"{', '.join(self.cfg.content_types)} (openai.fetch.content_types)",
                          param)
        return ctype

    async def _read(self, r: aiohttp.ClientResponse, url: SafeUrl, param: str) -> bytes:
        limit = self.cfg.max_bytes
        too_large = ProxyError(ErrorKind.TOO_LARGE, f"{param}: the image at {url.text} is "
                               f"larger than {limit} bytes (openai.fetch.max_bytes)", param=param)
        if r.content_length is not None and r.content_length > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in r.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

