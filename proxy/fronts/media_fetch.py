"""Safe mode for remote images (``openai.remote_images: fetch``): mmguard fetches an allow-listed
image itself and sends it to the backend inline, as a ``data:`` URL, so the model server never
fetches anything a client named.

Why not let vLLM fetch it: vLLM follows redirects (an allow-listed host that redirects elsewhere
is followed) and resolves names itself (a name that resolves to another address at fetch time —
DNS rebinding — is fetched). Here every hop is checked:

- each URL, the first and every redirect target, is parsed strictly and must be allow-listed;
- one address rule: an allow-list entry is a host *and a port*, named or literal. The name is
  resolved once, every address is checked with the port, and the connection goes to a checked
  address and that port only (the check runs inside the connector's resolver, so nothing can
  change in between): an (address, port) passes when a literal entry names both, the address is
  inside ``fetch.allow_networks``, or it is a globally routable address. (A literal entry once
  allowed its address on any port: with ``127.0.0.1:22760`` and ``localhost:22761`` listed,
  ``localhost:22761`` reached 127.0.0.1:22761, which nobody allowed.)
- at most ``fetch.max_redirects`` hops, ``fetch.timeout_s`` for the whole fetch,
  ``fetch.max_bytes`` read (counted as the body arrives), and a ``Content-Type`` from
  ``fetch.content_types``. No client header, cookie or proxy setting travels with the fetch.
- a budget for the amplifier (four 756-byte chats naming eight 7.9 MiB images each once cost
  +1080 MiB and sent 84 MiB bodies to a backend whose clients are held to 16 MiB):
  ``fetch.max_request_bytes`` per request, and never more than keeps the body sent on within
  the listener's own limit on OpenAI bodies (``max_json_bytes``); ``fetch.max_pod_bytes`` held
  by the whole pod until the requests are answered (429 and ``Retry-After`` past it);
  ``fetch.max_concurrent`` fetches in flight in the pod (more wait for a place within
  ``fetch.timeout_s``). Each byte is counted as it arrives, so a refusal costs at most one
  read chunk beyond the limit.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import socket
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from proxy.call import Call
from proxy.config.model import RemoteImageFetch
from proxy.errors import ErrorKind, ProxyError
from proxy.pod.counters import InFlight
from proxy.wire.media_urls import HostAllowList, SafeUrl, parse_url, refused
from proxy.wire.openai_parts import UrlSite, url_sites

log = logging.getLogger("mmguard.media_fetch")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressRefused(aiohttp.ClientError):
    """A name resolved only to addresses the rule does not allow."""


class CheckedResolver(AbstractResolver):
    """Resolves a name and hands the connector only the (address, port) pairs that pass."""

    def __init__(self, named: frozenset[tuple[str, int]],
                 networks: tuple[IpNetwork, ...]) -> None:
        self.named = named
        self.networks = networks

    def allows(self, address: str, port: int) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ((str(ip), port) in self.named or any(ip in net for net in self.networks)
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
            if self.allows(address, port):
                out.append({"hostname": host, "host": address, "port": port,
                            "family": fam, "proto": proto, "flags": socket.AI_NUMERICHOST})
        if not out:
            raise AddressRefused(f"{host} resolved to {sorted(set(seen))}: none is allow-listed "
                                 f"with port {port}, in openai.fetch.allow_networks, or a "
                                 "global address")
        return out

    async def close(self) -> None:
        return None


_DATA_PREFIX = 64
"""Bytes an inlined image adds besides its base64 (``data:image/webp;base64,`` and quotes)."""
_POD: dict[str, InFlight] = {}


def _pod_count(name: str) -> InFlight:
    """One pod-wide count per process (a reload's new fetcher shares it with the old one)."""
    if name not in _POD:
        _POD[name] = InFlight(f"\0mmguard/remote-images/{name}")
    return _POD[name]


class FetchBudget:
    """One request's share of the fetch budget: bytes fetched for it, and the pod's bytes it
    holds until ``release`` (its answer is sent)."""

    def __init__(self, cfg: RemoteImageFetch, limit: int, setting: str) -> None:
        self.cfg = cfg
        self.limit = limit
        self.setting = setting
        self.used = 0
        self._held = _pod_count("bytes")

    def take(self, n: int, url: SafeUrl, param: str) -> None:
        """Count ``n`` more bytes; a refusal gives back at once everything this request held,
        so the requests still fetching never see the pod fuller than it is."""
        self.used += n
        pod = self._held.add(n)
        if self.used > self.limit:
            self.release()
            raise ProxyError(ErrorKind.TOO_LARGE, f"{param}: fetching {url.text} takes this "
                             f"request's remote images past {self.limit} bytes "
                             f"({self.setting})", param=param)
        if pod > self.cfg.max_pod_bytes:
            self.release()
            raise ProxyError(ErrorKind.OVERLOADED, f"{param}: remote images fetched and not yet "
                             f"answered hold {pod} bytes, past the pod's "
                             f"{self.cfg.max_pod_bytes} (openai.fetch.max_pod_bytes); try again",
                             param=param, retry_after_s=1)

    def release(self) -> None:
        used, self.used = self.used, 0
        if used:
            self._held.add(-used)


async def _fetch_slot(cfg: RemoteImageFetch) -> None:
    """Wait for a place among the pod's ``max_concurrent`` fetches (the caller's timeout
    bounds the wait); the caller gives it back with ``_pod_count("fetches").add(-1)``."""
    fetches = _pod_count("fetches")
    while fetches.add(1) > cfg.max_concurrent:
        fetches.add(-1)
        await asyncio.sleep(0.02)


class ImageFetcher:
    def __init__(self, cfg: RemoteImageFetch, allow: HostAllowList) -> None:
        self.cfg = cfg
        self.allow = allow
        self.resolver = CheckedResolver(
            allow.literal_endpoints(),
            tuple(ipaddress.ip_network(n, strict=False) for n in cfg.allow_networks))
        self._session: aiohttp.ClientSession | None = None
        self._busy = 0  # calls fetching with it now
        self._retired = False

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=self.resolver, use_dns_cache=False,
                                             limit=32, force_close=True)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def retire(self) -> None:
        """A reload replaced it: closed once no call fetches with it. A call that read the old
        config before the reload (its body may take long to arrive) still fetches with it, and
        the last such call closes it (the session is never left open, nor closed under one)."""
        self._retired = True
        if not self._busy:
            await self.close()

    def budget(self, call: Call, body: bytes, images: int, listener_limit: int) -> FetchBudget:
        """A request's budget: ``fetch.max_request_bytes``, and no more than keeps the body
        sent on within ``listener_limit``: the document as it will be re-encoded (JSON escapes
        non-ASCII text), each image 4/3 larger once inlined, plus its ``data:`` prefix."""
        size = len(body)
        if not body.isascii():
            size = len(json.dumps(call.document, separators=(",", ":")))
        room = max(0, listener_limit - size - _DATA_PREFIX * images) * 3 // 4
        if room < self.cfg.max_request_bytes:
            return FetchBudget(self.cfg, room, "the body sent on would pass the listener's "
                                               f"limit, {listener_limit} bytes: "
                                               "listeners.http.max_json_bytes")
        return FetchBudget(self.cfg, self.cfg.max_request_bytes, "openai.fetch.max_request_bytes")

    async def inline(self, call: Call, body: bytes, listener_limit: int,
                     held: list[FetchBudget], found: list[UrlSite] | None = None) -> int:
        """Fetch every remote image of the call and put it in the document as a data: URL;
        returns how many were fetched. The call is re-encoded when any was. The bytes are
        counted in a budget put in ``held``, which the caller releases once the call is
        answered. ``found``: the remote images already found in the document
        (``apply_url_policy``'s walk)."""
        assert call.document is not None
        sites = (found if found is not None else
                 [s for s in url_sites(call.document) if s.remote and s.image])
        if not sites:
            return 0
        budget = self.budget(call, body, len(sites), listener_limit)
        held.append(budget)
        self._busy += 1
        try:
            async with asyncio.TaskGroup() as group:  # one refusal cancels the other fetches
                for site in sites:
                    group.create_task(self._inline_one(site, budget))
        except BaseExceptionGroup as failed:
            first = failed.exceptions[0]
            raise first if isinstance(first, ProxyError) else failed from None
        finally:
            self._busy -= 1
            if self._retired and not self._busy:
                await self.close()
        call.wire = None
        return len(sites)

    async def _inline_one(self, site: UrlSite, budget: FetchBudget) -> None:
        url = self.allow.check(site.url, site.where)
        ctype, data = await self.fetch(url, site.where, budget)
        site.holder[site.key] = f"data:{ctype};base64,{base64.b64encode(data).decode()}"

    async def fetch(self, url: SafeUrl, param: str,
                    budget: FetchBudget) -> tuple[str, bytes]:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await _fetch_slot(self.cfg)
                try:
                    return await self._follow(url, param, budget)
                finally:
                    _pod_count("fetches").add(-1)
        except TimeoutError:
            raise refused(f"{param}: fetching {url.text} took longer than "
                          f"{self.cfg.timeout_s} s (openai.fetch.timeout_s)", param) from None
        except AddressRefused as exc:
            raise refused(f"{param}: {exc}; mmguard did not fetch {url.text}", param) from None
        except aiohttp.ClientError as exc:
            raise refused(f"{param}: could not fetch {url.text}: {type(exc).__name__}: {exc}",
                          param) from None

    async def _follow(self, url: SafeUrl, param: str,
                      budget: FetchBudget) -> tuple[str, bytes]:
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
                ctype = self._content_type(r, url, param)
                return ctype, await self._read(r, url, param, budget)
        raise refused(f"{param}: {url.text} redirected more than {self.cfg.max_redirects} times "
                      "(openai.fetch.max_redirects)", param)

    def _content_type(self, r: aiohttp.ClientResponse, url: SafeUrl, param: str) -> str:
        ctype = r.content_type.lower()
        if ctype not in self.cfg.content_types:
            raise refused(f"{param}: {url.text} sent Content-Type {ctype!r}; mmguard takes "
                          f"{', '.join(self.cfg.content_types)} (openai.fetch.content_types)",
                          param)
        return ctype

    async def _read(self, r: aiohttp.ClientResponse, url: SafeUrl, param: str,
                    budget: FetchBudget) -> bytes:
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
            budget.take(len(chunk), url, param)
            chunks.append(chunk)
        return b"".join(chunks)

