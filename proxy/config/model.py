"""mmguard's configuration: one YAML file validated into frozen, typed models.

Unknown keys are refused everywhere (``extra="forbid"``). Errors name the key path and the reason,
e.g. ``models[0].filters[1].limits.max_batch: Input should be greater than 0``. The backends'
models are in ``proxy.config.backends``. Each filter's own config model lives beside the filter
and is found through its factory; ``load_config`` validates those too, so ``mmguard
check-config`` catches a bad filter option before anything serves. The listeners' models are in
``proxy.config.listeners``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from proxy.config.backends import (
    BackendConfig,
    OnnxRuntimeBackendConfig,
)
from proxy.config.listeners import Listeners
from proxy.config.refs import (
    model_dir_problems,
    read_secret,
    reference_problems,
    unreadable_value,
)
from proxy.files import CONFIG_BYTES, read_bounded, regular_file_problem
from proxy.lifecycle import ConfigReferences
from proxy.registry import filter_factories
from proxy.strict import Strict
from proxy.telemetry.settings import TelemetryConfig

MiB = 1024 * 1024


class RemoteImageFetch(Strict):
    """Limits of mmguard's own fetch of an allow-listed image (``remote_images: fetch``)."""

    max_bytes: int = Field(8 << 20, gt=0)
    """The most bytes one image may have (counted as it arrives, past any compression)."""
    timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    """The whole fetch of one image, redirects included."""
    max_redirects: int = Field(3, ge=0, le=10)
    """Redirects followed; each target must itself be allow-listed."""
    max_images: int = Field(8, ge=1)
    """Remote images one request may name (each is a fetch mmguard makes for the client)."""
    max_request_bytes: int = Field(16 << 20, gt=0)
    """Bytes fetched for one request, all its images together. Whatever this says, a request's
    images never make the body sent to the backend larger than the listener's own
    ``max_request_bytes`` (inlined as base64, an image takes 4/3 of its size)."""
    max_pod_bytes: int = Field(64 << 20, gt=0)
    """Fetched image bytes the pod holds at once, across all requests and workers (from the
    first byte fetched until the request's answer); past it a request is refused with 429 and
    ``Retry-After`` instead of adding its images."""
    max_concurrent: int = Field(8, ge=1)
    """Fetches in flight at once in the pod; more wait (within ``timeout_s``) for a place."""
    content_types: tuple[str, ...] = ("image/png", "image/jpeg", "image/webp", "image/gif",
                                      "image/bmp")
    """Content-Types accepted from the image host (anything else is refused, SVG included)."""
    allow_networks: tuple[str, ...] = ()
    """CIDRs a host *name* may resolve into besides globally routable addresses (an allow-listed
    IP literal is always allowed). Checked after DNS, on the address connected to."""

    @model_validator(mode="after")
    def _networks(self) -> RemoteImageFetch:
        import ipaddress
        for net in self.allow_networks:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad entry
        return self


class OpenAIConfig(Strict):
    image_url_allow_hosts: tuple[str, ...] = ()
    """``host`` or ``host:port`` (``[::1]:port``) whose http(s) media URLs are allowed; a bare host
    means the scheme's default port. Everything else must be inline ``data:`` URLs."""
    remote_images: Literal["fetch", "forward"] = "fetch"
    """``fetch``: mmguard fetches allow-listed images itself (``fetch`` limits, redirects and
    resolved addresses checked) and sends them inline; remote audio/video URLs are refused.
    ``forward``: the checked URL goes to the backend, which fetches it (see docs/openai.md for
    the vLLM flags that must then close redirects and other hosts)."""
    fetch: RemoteImageFetch = RemoteImageFetch()

    @model_validator(mode="after")
    def _hosts(self) -> OpenAIConfig:
        from proxy.wire.media_urls import parse_allow_entry
        for entry in self.image_url_allow_hosts:
            parse_allow_entry(entry)  # ValueError names the entry and what is wrong
        return self


class Eligibility(Strict):
    """One condition on a score a filter published on the call (``proxy.call.SCORES``)."""

    score: str = Field(pattern=r"^[a-z_]+\.[a-z_]+$")
    """``<filter>.<score>``: ``quality.alignment`` (image–text alignment), ``quality.trust``,
    ``quality.image``, ``quality.text`` or ``quality.<signal>`` (e.g. ``quality.sharpness``)."""
    at_least: float | None = None
    """Eligible when the score is at least this."""
    below: float | None = None
    """Eligible when the score is below this."""

    @model_validator(mode="after")
    def _bound(self) -> Eligibility:
        if (self.at_least is None) == (self.below is None):
            raise ValueError(f"eligibility on '{self.score}' needs exactly one of at_least "
                             "and below")
        return self

    def __str__(self) -> str:
        return (f"{self.score} >= {self.at_least:g}" if self.at_least is not None
                else f"{self.score} < {self.below:g}")


class CanaryConfig(Strict):
    """Which calls are canary traffic: the only calls that fault experiments may touch."""

    headers: dict[str, str] = Field(default_factory=dict)
    """Header → value that marks a call as canary (all must match; ``"*"`` matches any value).
    Clients' copies are stripped unless the listener has ``trust_canary_headers``."""
    share: float = Field(0.0, ge=0.0, le=1.0)
    """A share of all traffic chosen stably by ``key``: the same key is always in or out."""
    eligible: tuple[Eligibility, ...] = ()
    """Only calls whose published scores meet every condition may enter ``share`` (and a
    shadow's mirrored share): the gray release of the source documents, "the samples whose
    image–text alignment is above 0.85 first". A call with no such score is not eligible.
    Calls selected by ``headers`` (a trusted operator's choice) are not filtered."""
    key: str = "x-request-id"
    """Header whose value picks the share; the request id when absent; random when neither. The
    shadow filter's percent and the fault experiments' shares are chosen on the same key."""
    secret_file: Path | None = None
    """The secret that keys share membership (HMAC-SHA256), from a file (a mounted Secret), so
    clients cannot compute which keys are in a share. Replicas sharing it agree on membership.
    Without it (nor ``secret_env``) each process draws its own secret at start."""
    secret_env: str | None = None
    """The membership secret from this environment variable."""

    @model_validator(mode="after")
    def _one_secret(self) -> CanaryConfig:
        if self.secret_file is not None and self.secret_env is not None:
            raise ValueError("the canary secret comes from one source; secret_file and "
                             "secret_env are both set")
        self.resolve_secret()
        return self

    def resolve_secret(self) -> str | None:
        """The membership secret (read now); None when none is configured."""
        return read_secret("secret", None, self.secret_file, self.secret_env,
                           "share membership would be computable by clients")


class KServeV2Config(Strict):
    """How the KServe v2 fronts answer what is not inference: the repository API and server
    metadata. Both speak for one Triton backend (``backend``)."""

    repository_api: bool = False
    """Forward repository index / load / unload to the backend. Off (the default): both fronts
    refuse them alike (gRPC UNIMPLEMENTED, HTTP 501, a JSON error saying how to turn it on).
    On: every call needs the admin token (``Authorization: Bearer <token>``, on gRPC as
    ``authorization`` metadata), since loading or unloading changes what every client gets;
    the token is ``listeners.admin``'s and must be set."""
    backend: str | None = None
    """The Triton backend (triton_grpc or triton_http) the repository API and ``backend``
    server metadata speak for; the only Triton backend when absent."""
    server_metadata: Literal["backend", "mmguard"] = "backend"
    """``backend``: ServerMetadata answers the backend's own name, version and extensions (so
    clients that check for Triton keep working), less the extensions mmguard refuses, plus
    ``mmguard``; the answer carries an ``mmguard-version`` header (gRPC: initial metadata).
    ``mmguard``: mmguard's own name, version and extensions. Falls back to ``mmguard`` when no
    single Triton backend is configured or the backend does not answer."""


class FilterSpec(Strict):
    name: str
    config: BaseModel
    """The filter's own config model, validated once at load."""


class ModelRoute(Strict):
    name: str
    """The model name clients use."""
    backend: str
    backend_model: str | None = None
    """The name the backend knows; defaults to ``name``."""
    version: str = ""
    filters: tuple[dict[str, Any], ...] | None = None
    """Filter chain, outermost first, as ``- <filter>: {options}``; defaults.filters when absent."""
    timeout_s: float | None = Field(None, gt=0)
    """Overall deadline for this model (the client's own deadline still wins when shorter)."""
    internal: bool | None = None
    """Served to mmguard's own calls only (a shadow's copies, a fallback, a reroute): clients
    calling it get the unknown-model answer, and no listing names it. Unset: internal when a
    shadow names it as its canary (a client that could call the canary could load it, and
    that load would read as the canary's); ``false`` serves it to clients too."""


class Defaults(Strict):
    filters: tuple[dict[str, Any], ...] = ({"limits": {}},)


class SharedMemoryConfig(Strict):
    """Triton's system shared memory extension on the v2 fronts (docs/shared-memory.md)."""

    system: bool = False
    """Serve system shared memory: clients on this host (loopback peers only) register regions of
    /dev/shm and send/receive tensors in them. Off: the register/status/unregister calls and any
    tensor in a region answer UNIMPLEMENTED / 501 saying how to turn it on."""
    allowed_uids: tuple[int, ...] | None = None
    """If set, only client processes running as one of these uids may use shared memory (the uid
    is asked of the kernel for the client's socket, never read from the request)."""
    max_regions_per_client: int = Field(64, ge=1)
    """Regions one client uid may hold registered at once."""
    max_region_bytes: int = Field(1024 * MiB, gt=0)
    """The largest region a client may register (mmguard maps it whole)."""
    zero_copy: bool = False
    """Map regions and read input tensors in place (a memoryview over the mapping) instead of one
    pread per tensor. Only for clients trusted not to crash mmguard: a client that shrinks its
    file while it is mapped makes the next read of it kill mmguard with SIGBUS, and one that
    rewrites its region while its request is in flight can make the backend see other bytes than
    the filters checked. Off: each tensor is copied once, and a shrunk file is a clear error."""


class Config(Strict):
    _chains: dict[str, tuple[FilterSpec, ...]] = PrivateAttr(default_factory=dict)
    _source: bytes | None = PrivateAttr(None)
    listeners: Listeners = Listeners()
    backends: tuple[BackendConfig, ...]
    models: tuple[ModelRoute, ...]
    defaults: Defaults = Defaults()
    telemetry: TelemetryConfig = TelemetryConfig()
    openai: OpenAIConfig = OpenAIConfig()
    canary: CanaryConfig = CanaryConfig()
    shared_memory: SharedMemoryConfig = SharedMemoryConfig()
    v2: KServeV2Config = KServeV2Config()
    contract_refresh_s: float = Field(30.0, gt=0)
    """How often each backend's contract is re-read (a model reload is noticed within this)."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    """A stop: how long the fronts drain their calls before the rest is cut. A reload: the
    least time the replaced runtime stays open (it then waits for its last call, however long)."""
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Worker processes sharing the data ports (``--workers`` wins); ``auto``: the CPUs the
    process may use (affinity and cgroup quota). Over 1: a supervisor owns the admin port and
    the pod's one control state (docs/workers.md). Read at start only."""
    watch_config_s: float = Field(2.0, ge=0)
    """How often the config file and the TLS files it names are checked for a change (a
    ConfigMap update is a symlink swap); a change reloads as SIGHUP does. 0: not watched."""

    @model_validator(mode="after")
    def _references(self) -> Config:
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"backend names must be unique; repeated: {sorted(dup)}")
        models = [m.name for m in self.models]
        dup = {n for n in models if models.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique; repeated: {sorted(dup)}")
        listed = {b.name: b.models for b in self.backends
                  if isinstance(b, OnnxRuntimeBackendConfig) and b.models is not None}
        for m in self.models:
            if m.backend not in names:
                raise ValueError(f"model '{m.name}' names backend '{m.backend}', "
                                 f"which is not among the backends {names}")
            wanted = m.backend_model or m.name
            if m.backend in listed and wanted not in listed[m.backend]:
                raise ValueError(f"model '{m.name}' asks backend '{m.backend}' for "
                                 f"'{wanted}', which is not among the models it loads "
                                 f"{list(listed[m.backend])}")
        return self

    @model_validator(mode="after")
    def _v2_backend(self) -> Config:
        tritons = [b.name for b in self.backends if b.kind in ("triton_grpc", "triton_http")]
        v2 = self.v2
        if v2.backend is not None and v2.backend not in tritons:
            raise ValueError(f"v2.backend '{v2.backend}' is not a Triton backend (Triton "
                             f"backends: {tritons})")
        if v2.repository_api:
            if v2.backend is None and len(tritons) != 1:
                raise ValueError(f"v2.repository_api needs one Triton backend to speak for: "
                                 f"set v2.backend (Triton backends: {tritons})")
            if not self.listeners.admin._token_digest:
                raise ValueError("v2.repository_api needs the admin token (listeners.admin."
                                 "token, token_file or token_env): without it anyone could "
                                 "load and unload models")
        return self

    def v2_backend(self) -> str | None:
        """The Triton backend the v2 repository API and server metadata speak for, if any."""
        if self.v2.backend is not None:
            return self.v2.backend
        tritons = [b.name for b in self.backends if b.kind in ("triton_grpc", "triton_http")]
        return tritons[0] if len(tritons) == 1 else None

    def route_filters(self, route: ModelRoute) -> tuple[dict[str, Any], ...]:
        return route.filters if route.filters is not None else self.defaults.filters

    @property
    def source(self) -> bytes | None:
        """The file's bytes as read when this config was loaded (None when not from a file)."""
        return self._source

    def internal_routes(self) -> frozenset[str]:
        """The routes clients may not call (``ModelRoute.internal``; unset: named internal by
        a filter, e.g. a shadow's canary)."""
        named = {name for _, refs in _route_references(self) for name in refs.internal}
        return frozenset(r.name for r in self.models
                         if (r.internal if r.internal is not None else r.name in named))

    def chain(self, route: ModelRoute) -> tuple[FilterSpec, ...]:
        """The route's filters with their typed configs, validated once (``parse_config``
        fills them; a ``Config`` made otherwise validates a route's list on first use)."""
        found = self._chains.get(route.name)
        if found is None:
            where = (f"models[{route.name}].filters" if route.filters is not None
                     else "defaults.filters")
            found = self._chains[route.name] = tuple(
                resolve_filters(self.route_filters(route), where))
        return found


class ConfigError(Exception):
    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  {p}" for p in problems))


def resolve_filters(entries: tuple[dict[str, Any], ...], path: str) -> list[FilterSpec]:
    """Validate a filter list against each filter's own config model."""
    factories = filter_factories()
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict) or len(entry) != 1:
            problems.append(f"{where}: each filter is a one-key mapping '<filter>: {{options}}'")
            continue
        (name, options), = entry.items()
        if name not in factories:
            problems.append(f"{where}: unknown filter '{name}' (known: {sorted(factories)}; "
                            "a filter is found through its 'mmguard.filters' entry point once its "
                            "package is installed: after adding one, run pip install -e . again)")
            continue
        try:
            cfg = factories[name].config_model.model_validate(options or {})
        except ValidationError as exc:
            problems.extend(_format(exc, f"{where}.{name}"))
            continue
        specs.append(FilterSpec(name=name, config=cfg))
    if problems:
        raise ConfigError(problems)
    return specs


def parse_config(doc: Any, source: str = "config") -> Config:
    """Validate a document: every model, every filter's options, and what they name."""
    if doc is None:
        raise ConfigError(["the file is empty"], source)
    try:
        cfg = Config.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(_format(exc, ""), source) from None
    problems: list[str] = []
    for i, route in enumerate(cfg.models):  # each list once: a default list is shared
        where = f"models[{i}].filters" if route.filters is not None else "defaults.filters"
        try:
            cfg._chains[route.name] = tuple(resolve_filters(cfg.route_filters(route), where))
        except ConfigError as err:
            problems.extend(p for p in err.problems if p not in problems)
    if not cfg.models or all(r.filters is not None for r in cfg.models):
        try:  # the defaults are checked even when no route uses them
            resolve_filters(cfg.defaults.filters, "defaults.filters")
        except ConfigError as err:
            problems.extend(err.problems)
    if not problems:
        problems = reference_problems({m.name for m in cfg.models}, _route_references(cfg))
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _route_references(cfg: Config) -> list[tuple[str, ConfigReferences]]:
    """(where, references) of every filter of every route, as the route runs it."""
    found = []
    for i, route in enumerate(cfg.models):
        where = f"models[{i}].filters" if route.filters is not None else "defaults.filters"
        for j, spec in enumerate(cfg.chain(route)):
            refs = getattr(spec.config, "references", None)
            if refs is not None:
                found.append((f"models[{i}] ({route.name}): {where}[{j}].{spec.name}", refs()))
    return found


def load_config(path: str | Path, *, check_files: bool = False) -> Config:
    """Read, parse and validate a config file; every problem is one line of the ConfigError.
    ``check_files`` also checks what the config names on this machine (``file_problems``):
    ``serve``, reloads and ``check-config`` do; a config checked elsewhere need not."""
    try:
        data = read_bounded(path, CONFIG_BYTES)
    except ValueError as exc:
        raise ConfigError([str(exc)], str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([f"not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} "
                           f"(offset {exc.start}); save the file as UTF-8"], str(path)) from None
    with _no_cyclic_gc():
        try:
            doc = yaml.load(text, Loader=_Loader)  # a safe loader (libyaml's when available)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], str(path)) from None
        except ValueError as exc:  # int() past Python's digit limit, from the YAML constructor
            raise ConfigError([unreadable_value(exc)], str(path)) from None
        cfg = parse_config(doc, str(path))
    cfg._source = data  # the bytes this config came from: a pod's workers start from them
    if check_files and (problems := file_problems(cfg)):
        raise ConfigError(problems, str(path))
    return cfg


def pod_files(cfg: Config) -> list[str]:
    """What ``file_problems`` would look for: the model directories and the files filters
    read (``check-config --offline`` names them as not checked)."""
    found = [f"{b.name}.model_dir {b.model_dir}" for b in cfg.backends
             if isinstance(b, OnnxRuntimeBackendConfig)]
    return found + [f"{where}.{option} {path}" for where, refs in _route_references(cfg)
                    for option, path in refs.files]


def file_problems(cfg: Config) -> list[str]:
    """What ``serve`` would find missing on this machine: model directories and the models
    listed in them, and the files filters read when built."""
    problems = []
    for i, b in enumerate(cfg.backends):
        if isinstance(b, OnnxRuntimeBackendConfig):
            problems += model_dir_problems(f"backends[{i}] ({b.name})", b.model_dir, b.models)
    for where, refs in _route_references(cfg):
        problems += [f"{where}.{option}: {why}" for option, path in refs.files
                     if (why := regular_file_problem(path)) is not None]
    return problems


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A large file makes millions of short-lived YAML nodes, and the cyclic collector rescans
    them all again and again while holding the GIL: a 15 MiB file loaded 3x slower, and the
    event loop (serving, while a reload loads in a thread) paused for seconds. Nodes form no
    cycles, so reference counting frees them; the collector is off only meanwhile."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader parses a large file several times faster; the same safe constructors."""


def _format(exc: ValidationError, prefix: str) -> list[str]:
    out = []
    for err in exc.errors():
        path = prefix
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in ("triton_grpc", "triton_http", "onnxruntime", "vllm"):
                continue  # discriminator tag that pydantic adds to the location
            else:
                path += f".{part}" if path else str(part)
        out.append(f"{path or '(top level)'}: {err['msg']}")
    return out
