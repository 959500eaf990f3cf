"""The full chain's price (issue 18 item 2): mmguard's CPU per request with the default chain,
with the full chain a user would run, and with every filter added one at a time between them.

Used by ``python -m bench.proxy`` (``--chains``, ``--chain-study``, ``--chain-only``); the config
builder and the table are pure and unit-tested (``tests/unit/test_bench_chain.py``).

One extra mmguard process serves every chain at once, each on its own routes, so all chains are
measured against the same Triton, in the same run, by the same load generator:

* ``chain-<chain>-<proto>``: the route the load generator calls (``proto``: ``grpc`` → the
  ``triton_grpc`` backend, ``http`` → ``triton_http``; ``backend_model: pixel_identity``);
* ``...-canary``: the shadow's canary, a second route to the same Triton identity model;
* ``...-path-a`` / ``...-path-b``: the modality router's two paths (both take the image).

The chains are prefixes of :data:`STEPS` (outermost filter first): ``default`` is mmguard's
default chain (``limits: {}``), each later chain adds the next filter, ``full`` has them all with
the shadow mirroring 0 %, ``full_shadow10`` is ``full`` with the shadow mirroring 10 %, and
``full_lean`` is ``full`` with quality scoring 10 % of the calls and no answer cache, and
``full_no_quality`` is ``full`` without the quality filter (what the rest costs). Every
call is canary traffic (``x-canary: 1``, a trusted header), so the fault filter's running
experiment is evaluated on each call; its selector (``x-fault-drill``, which the load generator
never sends) picks none. The experiment is started through the admin API, as an operator would;
after each cell the bench reads it back (``matched`` must stay 0, ``injected`` empty), and the
load generator counts answers carrying ``mmguard-fault`` (must be 0).
"""

from __future__ import annotations

import json
import secrets
import statistics
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from bench.common import (
    NOISY_OTHER_PCT,
    MmguardProcess,
    fmt,
    proc_cpu_s,
    proc_minflt,
    render_table,
)

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from tests.support.triton import TritonServer

TRITON_MODEL, TRITON_IN, TRITON_OUT = "pixel_identity", "pixel_values", "pixel_out"
STEPS = ("limits", "shape_guard", "quality", "output_drift", "shadow", "fallback", "fault",
         "modality_router")
"""The full chain, outermost first. The router reroutes to its paths (each runs its own
chain), so it is innermost: a filter after it on the same route would never run."""
CHAINS: dict[str, tuple[int, float]] = {
    "default": (1, 0.0), "shape_guard": (2, 0.0), "quality": (3, 0.0), "output_drift": (4, 0.0),
    "shadow0": (5, 0.0), "fallback": (6, 0.0), "fault": (7, 0.0), "full": (8, 0.0),
    "full_shadow10": (8, 10.0), "full_lean": (8, 0.0), "full_no_quality": (8, 0.0),
}
"""Chain name → (how many of STEPS it runs, the shadow's mirroring percent)."""
VARIANTS = {"full_shadow10": "full", "full_lean": "full", "full_no_quality": "full"}
"""Chains that are ``full`` with one thing changed: their delta is over ``full``."""
LEAN = ("full_lean",)
"""``full`` with quality scoring 10 % of the calls and fallback without its answer cache (the
two costs that grow with the tensor: the image signals and the cache key's SHA-256)."""
WITHOUT = {"full_no_quality": "quality"}
"""Chains that are ``full`` less one filter: ``full_no_quality`` is what the rest of the full
chain costs, an upper bound on what any quality filter can leave to spend."""
STUDY = tuple(CHAINS)
DEFAULT_CHAINS = ("default", "full", "full_shadow10")
CANARY_HEADER = "x-canary"
DRILL_HEADER = "x-fault-drill"
FAULT_HEADER = "mmguard-fault"
PROTOCOLS = ("grpc", "http")


def photo_pixels() -> NDArray[np.float32] | None:
    """scikit-image's astronaut as a client sends it to a vision model: FP32 [1,3,224,224] in
    [0, 1] (``tests/support/photos.py``); None without the test extra (then the bench sends its
    seeded random tensor, which quality scores on its slower out-of-range path)."""
    try:
        import numpy as np

        from tests.support.photos import _load, to_model_input
        rgb = to_model_input(_load("astronaut"))
    except ImportError:
        return None
    chw = np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32) / np.float32(255)
    return chw.reshape(1, *chw.shape)


def parse_chains(text: str) -> list[str]:
    """``default,full`` → the chain names, in the study's order; ValueError naming the unknown
    ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHAINS]
    if unknown:
        raise ValueError(f"unknown chain(s) {unknown}; known: {', '.join(CHAINS)}")
    return [n for n in CHAINS if n in names]


def route(chain: str, proto: str, role: str = "") -> str:
    return f"chain-{chain}-{proto}" + (f"-{role}" if role else "")


def experiment_name(chain: str, proto: str) -> str:
    return f"drill-{chain}-{proto}"


def steps_of(chain: str) -> tuple[str, ...]:
    """The filters of ``chain``'s front route, outermost first."""
    return tuple(s for s in STEPS[:CHAINS[chain][0]] if s != WITHOUT.get(chain))


def chain_filters(chain: str, proto: str) -> list[dict[str, Any]]:
    """The filter list of one chain's front route (outermost first)."""
    shadow_percent = CHAINS[chain][1]
    configs: dict[str, dict[str, Any]] = {
        "limits": {},  # exactly the default chain
        # The token limit is declared on input_ids; the bench's image-only request has no token
        # input, so it is configured and looked up, never counted (see bench/README.md).
        "shape_guard": {"inputs": {"input_ids": {"max_tokens": 77, "pad_token_id": 0}}},
        "quality": {"images": {TRITON_IN: {}},  # default rules, annotate, drift on
                    **({"sample": 0.1} if chain in LEAN else {})},
        "output_drift": {"outputs": {"pixel_mean": {"kind": "scalar", "output": TRITON_OUT,
                                                    "range": [-1.0, 1.0]}}},
        # Latency is not judged: on a loaded machine the copies (queued behind the primary)
        # can read 1.5x slower and an abort verdict would stop the mirroring and the drill,
        # changing the chain under measurement. Answers are still compared (identical here).
        "shadow": {"canary": route(chain, proto, "canary"), "percent": shadow_percent,
                   "verdict": {"max_latency_ratio": None}},
        "fallback": {"breaker": {"window_size": 20, "minimum_calls": 5},
                     "cache": None if chain in LEAN else {"size": 1000, "ttl_s": 300}},
        "fault": {},  # its experiment is started through the admin API
        "modality_router": {"inputs": {TRITON_IN: "image"}, "paths": [
            {"route": route(chain, proto, "path-a"), "modalities": ["image"]},
            {"route": route(chain, proto, "path-b"), "modalities": ["image"]}]},
    }
    return [{name: configs[name]} for name in steps_of(chain)]


def chain_routes(chains: Sequence[str]) -> list[dict[str, Any]]:
    """Every route the chains need, for both protocols."""
    routes: list[dict[str, Any]] = []
    for chain in chains:
        steps = steps_of(chain)
        for proto in PROTOCOLS:
            backend = f"triton_{proto}"
            routes.append({"name": route(chain, proto), "backend": backend,
                           "backend_model": TRITON_MODEL, "filters": chain_filters(chain, proto)})
            roles = [*(["canary"] if "shadow" in steps else []),
                     *(["path-a", "path-b"] if "modality_router" in steps else [])]
            routes += [{"name": route(chain, proto, r), "backend": backend,
                        "backend_model": TRITON_MODEL, "filters": []} for r in roles]
    return routes


def chain_config(chains: Sequence[str], triton_grpc: str, triton_http: str, admin_token: str,
                 log_level: str = "warning") -> dict[str, Any]:
    """The mmguard config serving ``chains`` (see the module doc)."""
    return {
        "listeners": {"http": {"host": "127.0.0.1", "trust_canary_headers": True},
                      "grpc": {"host": "127.0.0.1", "trust_canary_headers": True},
                      "admin": {"host": "127.0.0.1", "token": admin_token}},
        "canary": {"headers": {CANARY_HEADER: "1"}},
        "backends": [{"kind": "triton_grpc", "name": "triton_grpc", "url": triton_grpc},
                     {"kind": "triton_http", "name": "triton_http", "url": f"http://{triton_http}"}],
        "models": chain_routes(chains),
        "telemetry": {"log_level": log_level},
        "shutdown_grace_s": 1.0,
    }


def has_fault(chain: str) -> bool:
    return "fault" in steps_of(chain)


def drill(chain: str, proto: str) -> dict[str, Any]:
    """The admin API body that starts the chain's experiment: an abort that would be seen at
    once, on calls carrying a header the bench never sends."""
    return {"route": route(chain, proto), "experiment": {
        "name": experiment_name(chain, proto), "headers": {DRILL_HEADER: "*"},
        "actions": [{"kind": "abort", "http_status": 503, "message": "bench drill"}]}}


def admin(port: int, method: str, path: str, token: str | None = None,
          body: object = None) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"}
                                             if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"null")


# ---------------------------------------------------------------------------------------------
# Summaries and the table (pure)
# ---------------------------------------------------------------------------------------------


def _cpu(cell: dict[str, Any]) -> float | None:
    if "failed" in cell:
        return None
    value = (cell.get("cpu_ms_per_req") or {}).get("mmguard")
    return None if value is None else float(value)


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (chain, protocol): median mmguard CPU ms/req over its rounds, spread, req/s,
    the delta over the previous chain measured and over ``default``, noise and fault counts."""
    rows: list[dict[str, Any]] = []
    for proto in PROTOCOLS:
        previous: float | None = None
        base: float | None = None
        for chain in CHAINS:
            mine = [c for c in cells if c.get("chain") == chain and c.get("protocol") == proto]
            if not mine:
                continue
            cpus = [v for v in map(_cpu, mine) if v is not None]
            rps = [float(c["rps"]) for c in mine if "failed" not in c and c.get("rps")]
            cpu = statistics.median(cpus) if cpus else None
            faults = [float(c["per_req"]["page_faults"]) for c in mine
                      if "failed" not in c and "page_faults" in (c.get("per_req") or {})]
            if chain == "default":
                base = cpu
            rows.append({
                "chain": chain, "protocol": proto, "rounds": len(mine),
                "filters": "+".join(steps_of(chain)),
                "shadow_percent": CHAINS[chain][1],
                "mmguard_cpu_ms_per_req": cpu,
                "cpu_min": min(cpus) if cpus else None, "cpu_max": max(cpus) if cpus else None,
                "rps": statistics.median(rps) if rps else None,
                "page_faults_per_req": statistics.median(faults) if faults else None,
                "delta_prev_ms": (cpu - previous if cpu is not None and previous is not None
                                  and chain != "default" else None),
                "delta_default_ms": (cpu - base if cpu is not None and base is not None
                                     and chain != "default" else None),
                "noisy": sum(1 for c in mine if (c.get("other_cpu_pct") or 0) > NOISY_OTHER_PCT),
                "failed": sum(1 for c in mine if "failed" in c or c.get("errors")),
                "fault_answers": sum(int(c.get("header_count") or 0) for c in mine),
                "experiment_matched": sum(int((c.get("experiment") or {}).get("matched") or 0)
                                          for c in mine),
            })
            if cpu is not None and chain not in VARIANTS:  # variants: compared with full below
                previous = cpu
            if chain in VARIANTS and cpu is not None:
                full = next((r for r in rows if r["chain"] == VARIANTS[chain]
                             and r["protocol"] == proto), None)
                rows[-1]["delta_prev_ms"] = (cpu - full["mmguard_cpu_ms_per_req"]
                                             if full and full["mmguard_cpu_ms_per_req"] is not None
                                             else None)
    return rows


ADDED = {"default": "(limits: the default chain)", "full": "+ modality_router = full",
         "shadow0": "+ shadow (0 %)", "full_shadow10": "full, shadow at 10 %",
         "full_lean": "full, quality on 10 %, no answer cache",
         "full_no_quality": "full less quality"}


def chain_table(rows: list[dict[str, Any]], md: bool) -> str:
    head = ["chain", "protocol", "mmguard CPU ms/req", "min-max", "Δ vs previous",
            "Δ vs default", "req/s", "page faults/req", "rounds", "noisy", "faulted answers"]
    body = []
    for r in rows:
        what = ADDED.get(r["chain"], f"+ {r['chain']}")
        spread = (f"{r['cpu_min']:.3f}-{r['cpu_max']:.3f}" if r["cpu_min"] is not None else "-")
        body.append([what, r["protocol"], fmt(r["mmguard_cpu_ms_per_req"], ".3f"), spread,
                     fmt(r["delta_prev_ms"], "+.3f"), fmt(r["delta_default_ms"], "+.3f"),
                     fmt(r["rps"], ".0f"), fmt(r.get("page_faults_per_req"), ".1f"),
                     str(r["rounds"]),
                     str(r["noisy"]) if r["noisy"] else "",
                     str(r["fault_answers"]) + (" FAILED" if r["failed"] else "")])
    return render_table(head, body, md)


def chain_notes(concurrency: int, rounds: int) -> list[str]:
    return [
        f"- Chain rows: FP32 [1,3,224,224] (600 KB) at concurrency {concurrency}, {rounds} "
        "round(s) of every chain, interleaved; *mmguard CPU ms/req* is the median over the "
        "rounds (*min-max*: its spread), from /proc, of the one mmguard process that serves "
        "every chain on its own routes.",
        "- *Δ vs previous*: the cost of the filter the row adds (the variants of full: over "
        "full). *Δ vs default*: over the default chain (`limits`). The issue's aim: full ≤ "
        "default + 0.3 ms.",
        "- Every chain call is canary traffic (trusted `x-canary: 1`); the fault filter's "
        f"experiment (started through the admin API) selects only `{DRILL_HEADER}` calls, "
        "which the bench never sends. *faulted answers*: answers carrying `mmguard-fault` "
        "(must be 0); the experiment's `matched` count is read back after each cell.",
        "- shape_guard's token limit is declared on `input_ids`, which the image-only request "
        "does not have; quality scores the image (default rules, drift on); output_drift reads "
        "the answer's mean (`scalar`); fallback has its breaker and answer cache; the shadow "
        "compares answers but does not judge latency (a loaded machine would abort it); the "
        "router chooses between two paths to the same model.",
        "- The request is a real photograph (scikit-image's astronaut, FP32 in [0, 1]; the "
        "seeded random tensor without the test extra); the first answer of every cell is "
        "checked byte for byte. *page faults/req*: mmguard's minor page faults per request.",
        "- Each filter's own CPU, free of the transport and of the machine's noise: "
        "`python -m bench.chain_profile --breakdown` (bench/README.md).",
    ]


def round_robin(chains: Sequence[str], rounds: int) -> list[tuple[int, str, str]]:
    """The cells in the order they run: every chain and protocol once per round, so a noisy
    stretch of the shared machine spreads over all chains instead of hitting one."""
    return [(r, chain, proto) for r in range(rounds) for chain in chains for proto in PROTOCOLS]


# ---------------------------------------------------------------------------------------------
# Running the study
# ---------------------------------------------------------------------------------------------


Probes: TypeAlias = "dict[str, Callable[[], float]]"
"""Name -> a function giving that process's CPU seconds (or a count) so far."""
Measure: TypeAlias = ("Callable[[dict[str, Any], str, Probes | None, Probes | None], "
                      "dict[str, Any]]")
"""``Bench.measure(spec, label, probes, counters)``: one cell through the load generator."""


class ChainMmguard(MmguardProcess):
    def __init__(self, root: Path, chains: Sequence[str], triton: TritonServer,
                 log_level: str) -> None:
        self.token = secrets.token_hex(16)
        super().__init__(root, chain_config(chains, triton.grpc_url, triton.http_url,
                                            self.token, log_level))


class ChainStudy:
    """Starts the chains' mmguard and its experiments; runs the cells through the bench's load
    generator (``measure(spec, label, probes)`` is ``Bench.measure``)."""

    def __init__(self, chains: Sequence[str], rounds: int, concurrency: int) -> None:
        self.chains = list(chains)
        self.rounds = rounds
        self.concurrency = concurrency
        self.mmguard: ChainMmguard | None = None
        self.cells: list[dict[str, Any]] = []
        self.payload = ""

    def start(self, root: Path, triton: TritonServer, log_level: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.payload = ("photo (scikit-image's astronaut)" if photo_pixels() is not None else
                        "seeded random tensor (no scikit-image: quality's out-of-range path)")
        print(f"  chain payload: {self.payload}", flush=True)
        self.mmguard = ChainMmguard(root, self.chains, triton, log_level)
        print(f"starting mmguard for the chains ({', '.join(self.chains)}) ...", flush=True)
        self.mmguard.start()
        for chain in self.chains:
            if not has_fault(chain):
                continue
            for proto in PROTOCOLS:
                status, doc = admin(self.mmguard.ports["admin"], "POST", "/admin/experiments",
                                    self.mmguard.token, drill(chain, proto))
                if status != 201:
                    raise RuntimeError(f"starting the fault experiment on {route(chain, proto)}"
                                       f" answered {status}: {doc}")
        print(f"  chains' mmguard ready (pid {self.mmguard.pid}); experiments started",
              flush=True)

    def stop(self) -> None:
        if self.mmguard is not None:
            self.mmguard.stop()

    def _after(self, cell: dict[str, Any], chain: str, proto: str) -> None:
        """What mmguard says about the cell: the experiment's counts, the shadow's."""
        assert self.mmguard is not None
        port = self.mmguard.ports["admin"]
        if has_fault(chain):
            status, doc = admin(port, "GET", f"/admin/experiments/{experiment_name(chain, proto)}")
            exp = doc if status == 200 and isinstance(doc, dict) else {}
            cell["experiment"] = {k: exp.get(k) for k in ("state", "matched", "injected")}
            if exp.get("state") != "running" or exp.get("matched") or exp.get("injected"):
                cell["failed"] = f"the fault experiment is not running unmatched: {exp}"
        if "shadow" in steps_of(chain):
            status, doc = admin(port, "GET", "/admin/shadows")
            snap = (doc or {}).get(route(chain, proto)) if status == 200 else None
            cell["shadow"] = {k: (snap or {}).get(k) for k in ("mirrored", "compared", "dropped")}
        if cell.get("header_count"):
            cell["failed"] = f"{cell['header_count']} answers carried {FAULT_HEADER}"

    def run(self, measure: Measure,
            probes: dict[str, Callable[[], float]]) -> list[dict[str, Any]]:
        assert self.mmguard is not None and self.mmguard.pid is not None
        pid = self.mmguard.pid
        probes = {**probes, "mmguard": lambda: proc_cpu_s(pid)}
        for rnd, chain, proto in round_robin(self.chains, self.rounds):
            print(f"chain {chain} {proto} c={self.concurrency} (round {rnd + 1}/{self.rounds})",
                  flush=True)
            spec = {"kind": proto, "case": "pixel", "protocol": proto,
                    "concurrency": self.concurrency, "shape": [1, 3, 224, 224],
                    "input": TRITON_IN, "output": TRITON_OUT, "op": "identity",
                    "target": "mmguard", "addr": f"127.0.0.1:{self.mmguard.ports[proto]}",
                    "model": route(chain, proto), "headers": {CANARY_HEADER: "1"},
                    "count_header": FAULT_HEADER, "payload": "photo"}
            cell = measure(spec, f"mmguard chain {chain} -> triton_{proto}", probes,
                           {"page_faults": lambda: proc_minflt(pid)})
            cell.update(chain=chain, round=rnd, payload=self.payload)
            self._after(cell, chain, proto)
            self.cells.append(cell)
        return self.cells
