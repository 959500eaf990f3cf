"""A real Triton Inference Server for tests and benchmarks, started from the nvidia-pytriton wheel.

Recipe
------
nvidia-pytriton 0.7.0 ships Triton 2.51 (``site-packages/pytriton/tritonserver/bin/tritonserver``)
with only the Python backend. We start that binary directly on a hand-written model repository
of Python-backend models (:func:`write_model_repository`); pytriton's own Python API is not used.

Traps (each one is handled by :class:`TritonServer`):

* ``LD_LIBRARY_PATH`` must hold the running interpreter's ``sysconfig.get_config_var("LIBDIR")``
  (else model load fails with ``'_thread.RLock' object has no attribute '_recursion_count'``) and
  the wheel's ``site-packages/nvidia_pytriton.libs`` (the binary's vendored .so files).
* The wheel's ``backends/python`` folder has NO ``triton_python_backend_stub``: the stubs sit in
  ``tritonserver/python_backend_stubs/<X.Y>/``, one per Python version, and pytriton copies the
  right one in at run time. We copy ``backends/`` into the work dir, add the stub for the
  running Python, and pass that folder as ``--backend-directory`` (the venv stays untouched).
* The venv's ``bin`` must come first on ``PATH``: the stub's embedded interpreter locates its
  prefix (hence numpy, onnxruntime) from the ``python3`` it finds there.
* Every server gets its own ``shm-region-prefix-name`` for the Python backend (regions are
  ``/dev/shm/<prefix><uuid>``, one per model instance). A clean exit unlinks them; a server
  that dies or is SIGKILLed leaves them behind, so :meth:`TritonServer.stop` deletes whatever
  still carries this server's prefix.
* tritonserver has no "port 0": free ports are picked by binding 127.0.0.1:0 and closing; the
  small race is covered by retrying the start with fresh ports. A taken port does not fail
  fast: all models load first, then the server logs ``Socket '127.0.0.1:N' already in use``
  and exits 1 without unloading them (stubs and shm regions left behind).
* The server runs in its own session (process group = its pid). Each Python model runs in a
  stub child process in that group; :meth:`TritonServer.stop` sends SIGTERM, waits, SIGKILLs,
  and finally SIGKILLs whatever is left of the group, so no stub survives. An atexit hook
  stops forgotten servers, and (when started from the main thread, with util-linux
  ``setpriv`` present) ``--pdeathsig TERM`` stops the server even if pytest is SIGKILLed.
* SIGTERM does not cancel in-flight requests: Triton waits ``--exit-timeout-secs`` (lowered
  here to 5 from 30) and then still waits for a busy Python model to return before unloading
  it, so a long slow_fp32 request keeps the server up until it ends or ``stop_timeout`` (15 s)
  triggers SIGKILL. A clean stop takes ~2 s (Triton's shutdown loop polls once a second).
* Model loading is mostly waiting on stub processes, not CPU: ``--model-load-thread-count`` is
  set to the number of models (ready in ~3 s on 2 cores rather than ~4.6 s with the default 4).
* Model metadata shows a leading -1 on every shape when ``max_batch_size >= 1``.

Models (all ``backend: "python"``, one KIND_CPU instance, no dynamic batching)
------------------------------------------------------------------------------
===================  ==========================================  ==============================  ===
model                inputs                                      outputs                         mbs
===================  ==========================================  ==============================  ===
identity_fp32        INPUT0 FP32 [-1]                            OUTPUT0 FP32 [-1]               8
identity_fp16        INPUT0 FP16 [-1]                            OUTPUT0 FP16 [-1]               8
identity_bf16        INPUT0 BF16 [-1]                            OUTPUT0 BF16 [-1]               8
identity_int64       INPUT0 INT64 [-1]                           OUTPUT0 INT64 [-1]              8
identity_bool        INPUT0 BOOL [-1]                            OUTPUT0 BOOL [-1]               8
identity_bytes       INPUT0 BYTES (TYPE_STRING) [-1]             OUTPUT0 BYTES [-1]              8
pixel_identity       pixel_values FP32 [3,224,224]               pixel_out FP32 [3,224,224]      8
small_fp32           x FP32 [16]                                 y FP32 [16] = 2 * x             8
clip_demo            pixel_values FP32 [3,224,224],              image_embeds FP32 [64],         8
                     input_ids INT64 [77]                        text_embeds FP32 [64],
                                                                 similarity FP32 [1] (see below)
slow_fp32            x FP32 [-1], delay_ms INT32 [1] (optional)  y FP32 [-1] = x                 8
fail_fp32            x FP32 [-1]                                 y FP32 [-1] (never sent)        8
sequence_accumulate  INPUT INT32 [1] (+ START, END, CORRID)      OUTPUT INT32 [1] (running sum)  32
decoupled_counter    count INT32 [1]                             value INT32 [1] (decoupled)     0
classify_fp32        x FP32 [10]                                 probs FP32 [10] (labels.txt)    0
echo_params          INPUT0 FP32 [-1]                            OUTPUT0 = INPUT0, PARAMS BYTES  0
===================  ==========================================  ==============================  ===

(Shapes above are config dims; with max_batch_size 8 the wire shapes get a leading batch dim.)

* identity_*: output bytes are byte-identical to the input (BF16 goes through DLPack, since
  numpy has no bfloat16; clients send it as ``ml_dtypes.bfloat16``, which tritonclient 2.73
  maps to "BF16").
* clip_demo: runs the ONNX file made by ``proxy.cli.demo_model.ensure_clip_demo`` with onnxruntime
  inside the Python model (path in config parameter ``onnx_path``). ONNX ``similarity`` is
  [batch]; Triton 2.51 rejects ``dims: []`` (``model output 'similarity' must specify
  'dims' for clip_demo``), so the config says
  ``dims: [1]`` + ``reshape: { shape: [] }``: clients see [batch, 1], the model emits [batch].
* slow_fp32: sleeps ``delay_ms`` ms (first element of the [batch, 1] tensor; input absent -> no
  sleep), then y = x. A separate input rather than x[0][0] so that x stays free data and a
  proxy's deadline can be tested with any payload. Cancellation-aware:
  on a cancelled request it answers CANCELLED and logs ``slow_fp32: cancelled after N ms``.
  One instance, so concurrent requests queue behind each other.
* fail_fp32: every request gets ``TritonError("deliberate failure from fail_fp32")`` (INTERNAL:
  gRPC ``StatusCode.INTERNAL``, HTTP 500).
* classify_fp32: probs = x, emitted as [1, 10, 1, 1] (``reshape``), clients see [10]; the
  output's ``label_filename`` gives the classification extension its labels.
* echo_params: PARAMS = [the request's parameters as the model sees them, JSON text].
* sequence_accumulate: sequence batcher (direct strategy, 32 slots) with START / END / CORRID
  control inputs; OUTPUT is the running sum of INPUT for the correlation id, so a request that
  arrives out of order gives a wrong sum (or an error, when it comes before its START).
* decoupled_counter: ``count`` responses ``value = [i]`` for i in 0..count-1, 10 ms apart, then an
  empty response flagged FINAL. Negative count -> one error response.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Self

from proxy.backends.triton_grpc import RECONNECT_BACKOFF_MAX_MS

__all__ = [
    "MODEL_NAMES",
    "TritonServer",
    "triton_available",
    "triton_paths",
    "write_model_repository",
]

_SOURCES = Path(__file__).resolve().parent / "triton_models"

# ---------------------------------------------------------------------------------------------
# Model repository
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    label_filename: str | None = None  # classification labels, a file beside config.pbtxt

    def pbtxt(self) -> str:
        lines = [
            f'    name: "{self.name}"',
            f"    data_type: {self.data_type}",
            f"    dims: [ {', '.join(str(d) for d in self.dims)} ]",
        ]
        if self.reshape is not None:
            lines.append(f"    reshape: {{ shape: [ {', '.join(str(d) for d in self.reshape)} ] }}")
        if self.optional:
            lines.append("    optional: true")
        if self.label_filename is not None:
            lines.append(f'    label_filename: "{self.label_filename}"')
        return "  {\n" + "\n".join(lines) + "\n  }"


@dataclass(frozen=True)
class _Model:
    name: str
    source: str  # file in triton_models/ copied to <name>/1/model.py
    inputs: tuple[_Tensor, ...]
    outputs: tuple[_Tensor, ...]
    max_batch_size: int = 8
    decoupled: bool = False
    parameters: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (name beside config.pbtxt, file in triton_models/)
    scheduling: str = ""  # a scheduler block (sequence_batching { ... }) as pbtxt

    def pbtxt(self, extra_parameters: dict[str, str] | None = None) -> str:
        params = dict(self.parameters)
        params.update(extra_parameters or {})
        parts = [
            f'name: "{self.name}"',
            'backend: "python"',
            f"max_batch_size: {self.max_batch_size}",
            "input [\n" + ",\n".join(t.pbtxt() for t in self.inputs) + "\n]",
            "output [\n" + ",\n".join(t.pbtxt() for t in self.outputs) + "\n]",
            "instance_group [ { count: 1, kind: KIND_CPU } ]",
        ]
        if self.decoupled:
            parts.append("model_transaction_policy { decoupled: true }")
        if self.scheduling:
            parts.append(self.scheduling)
        for key, value in params.items():
            parts.append(
                f'parameters {{ key: "{key}" value {{ string_value: {json.dumps(value)} }} }}'
            )
        return "\n".join(parts) + "\n"


def _identity(name: str, data_type: str) -> _Model:
    return _Model(
        name,
        "identity.py",
        (_Tensor("INPUT0", data_type, (-1,)),),
        (_Tensor("OUTPUT0", data_type, (-1,)),),
    )


_PIXEL = (3, 224, 224)

# Direct strategy: one batch slot per live sequence (32 slots, more than the 16 the tests run at
# once, so no sequence waits for another to end).
_SEQUENCE_BATCHING = """sequence_batching {
  max_sequence_idle_microseconds: 60000000
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}"""

_MODELS: tuple[_Model, ...] = (
    _identity("identity_fp32", "TYPE_FP32"),
    _identity("identity_fp64", "TYPE_FP64"),
    _identity("identity_fp16", "TYPE_FP16"),
    _identity("identity_bf16", "TYPE_BF16"),
    _identity("identity_int64", "TYPE_INT64"),
    _identity("identity_bool", "TYPE_BOOL"),
    _identity("identity_bytes", "TYPE_STRING"),
    _Model(
        "pixel_identity",
        "identity.py",
        (_Tensor("pixel_values", "TYPE_FP32", _PIXEL),),
        (_Tensor("pixel_out", "TYPE_FP32", _PIXEL),),
    ),
    _Model(
        "small_fp32",
        "double.py",
        (_Tensor("x", "TYPE_FP32", (16,)),),
        (_Tensor("y", "TYPE_FP32", (16,)),),
    ),
    _Model(
        "clip_demo",
        "clip_onnx.py",
        (_Tensor("pixel_values", "TYPE_FP32", _PIXEL), _Tensor("input_ids", "TYPE_INT64", (77,))),
        (
            _Tensor("image_embeds", "TYPE_FP32", (64,)),
            _Tensor("text_embeds", "TYPE_FP32", (64,)),
            _Tensor("similarity", "TYPE_FP32", (1,), reshape=()),
        ),
    ),
    _Model(  # chaos (issue 16): clip_demo whose answers flip under small input noise
        "clip_fragile",
        "clip_fragile.py",
        (_Tensor("pixel_values", "TYPE_FP32", _PIXEL), _Tensor("input_ids", "TYPE_INT64", (77,))),
        (
            _Tensor("image_embeds", "TYPE_FP32", (64,)),
            _Tensor("text_embeds", "TYPE_FP32", (64,)),
            _Tensor("similarity", "TYPE_FP32", (1,), reshape=()),
        ),
    ),
    _Model(
        "slow_fp32",
        "slow.py",
        (_Tensor("x", "TYPE_FP32", (-1,)), _Tensor("delay_ms", "TYPE_INT32", (1,), optional=True)),
        (_Tensor("y", "TYPE_FP32", (-1,)),),
    ),
    _Model(
        "fail_fp32",
        "fail.py",
        (_Tensor("x", "TYPE_FP32", (-1,)),),
        (_Tensor("y", "TYPE_FP32", (-1,)),),
    ),
    _Model(  # shape guard: a fixed dim and a small max_batch_size
        "batch4_fp32",
        "double.py",
        (_Tensor("x", "TYPE_FP32", (16,)),),
        (_Tensor("y", "TYPE_FP32", (16,)),),
        max_batch_size=4,
    ),
    _Model(  # shape guard: cuts text at 77 tokens silently, as CLIP's tokenizer does
        "clip_text_trunc",
        "clip_text_trunc.py",
        (_Tensor("text", "TYPE_STRING", (1,)),),
        (_Tensor("tokens_read", "TYPE_INT32", (1,)), _Tensor("embedding", "TYPE_FP32", (8,))),
        max_batch_size=4,
    ),
    _Model(  # sequence batcher: START/END/CORRID controls, a running sum per correlation id
        "sequence_accumulate",
        "accumulate.py",
        (_Tensor("INPUT", "TYPE_INT32", (1,)),),
        (_Tensor("OUTPUT", "TYPE_INT32", (1,)),),
        max_batch_size=32,
        scheduling=_SEQUENCE_BATCHING,
    ),
    _Model(
        "decoupled_counter",
        "counter.py",
        (_Tensor("count", "TYPE_INT32", (1,)),),
        (_Tensor("value", "TYPE_INT32", (1,)),),
        max_batch_size=0,
        decoupled=True,
    ),
    _Model(  # classification extension with labels; no batching; int64 reshape in the config
        "classify_fp32",
        "classify.py",
        (_Tensor("x", "TYPE_FP32", (10,)),),
        (_Tensor("probs", "TYPE_FP32", (10,), reshape=(1, 10, 1, 1),
                 label_filename="labels.txt"),),
        max_batch_size=0,
        files=(("labels.txt", "classify_labels.txt"),),
    ),
    _Model(  # what the model sees of a request's parameters, as JSON text in PARAMS
        "echo_params",
        "echo_params.py",
        (_Tensor("INPUT0", "TYPE_FP32", (-1,)),),
        (_Tensor("OUTPUT0", "TYPE_FP32", (-1,)), _Tensor("PARAMS", "TYPE_STRING", (1,))),
        max_batch_size=0,
    ),
)

MODEL_NAMES: tuple[str, ...] = tuple(m.name for m in _MODELS)
DECOUPLED_MODELS: frozenset[str] = frozenset(m.name for m in _MODELS if m.decoupled)


def write_model_repository(dst: Path, onnx_demo_path: Path) -> Path:
    """Write every model (``config.pbtxt`` + ``1/model.py``) under ``dst``; return ``dst``.

    ``onnx_demo_path`` is the ``model.onnx`` from ``proxy.cli.demo_model.ensure_clip_demo``; its
    absolute path goes into clip_demo's ``onnx_path`` config parameter (the file is not copied).
    """
    dst = Path(dst)
    onnx_demo_path = Path(onnx_demo_path).resolve()
    if not onnx_demo_path.is_file():
        raise FileNotFoundError(f"clip_demo ONNX file not found: {onnx_demo_path}")
    for model in _MODELS:
        version_dir = dst / model.name / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        extra = ({"onnx_path": str(onnx_demo_path),
                  "cue_file": str(dst.resolve() / f"{model.name}.cue.json")}
                 if model.name in ("clip_demo", "clip_fragile") else None)
        (dst / model.name / "config.pbtxt").write_text(model.pbtxt(extra))
        shutil.copyfile(_SOURCES / model.source, version_dir / "model.py")
        for name, source in model.files:
            shutil.copyfile(_SOURCES / source, dst / model.name / name)
    return dst


# ---------------------------------------------------------------------------------------------
# Locating the binary
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonPaths:
    binary: Path
    backends: Path  # the wheel's backends/ (without the stub)
    stub: Path  # triton_python_backend_stub for the running Python
    libs: Path  # nvidia_pytriton.libs
    python_libdir: Path  # sysconfig LIBDIR (libpython3.X.so)


def triton_paths() -> TritonPaths:
    """Where the wheel's pieces are; raises RuntimeError with the reason when one is missing."""
    try:
        import pytriton  # type: ignore[import-untyped]  # only to find the wheel
    except ImportError as exc:
        raise RuntimeError(f"nvidia-pytriton is not installed ({exc})") from exc
    root = Path(pytriton.__file__).resolve().parent
    server_dir = root / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = TritonPaths(
        binary=server_dir / "bin" / "tritonserver",
        backends=server_dir / "backends",
        stub=server_dir / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent / "nvidia_pytriton.libs",
        python_libdir=Path(libdir),
    )
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the bundled tritonserver is Linux-only (platform {sys.platform})")
    if not paths.binary.is_file() or not os.access(paths.binary, os.X_OK):
        raise RuntimeError(f"tritonserver binary missing or not executable: {paths.binary}")
    if not (paths.backends / "python" / "libtriton_python.so").is_file():
        raise RuntimeError(f"python backend missing: {paths.backends / 'python'}")
    if not paths.stub.is_file():
        raise RuntimeError(f"no python backend stub for Python {version}: {paths.stub}")
    if not paths.libs.is_dir():
        raise RuntimeError(f"nvidia_pytriton.libs missing: {paths.libs}")
    if not libdir or not any(paths.python_libdir.glob("libpython3*.so*")):
        raise RuntimeError(f"no shared libpython in sysconfig LIBDIR {libdir!r}")
    return paths


def triton_available() -> tuple[bool, str]:
    """(True, binary path) if the bundled tritonserver can be started, else (False, why)."""
    try:
        return True, str(triton_paths().binary)
    except RuntimeError as exc:
        return False, str(exc)


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (all held open together so they differ)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_LIVE: set[TritonServer] = set()


@atexit.register
def _stop_all() -> None:  # last line of defence: never leave a tritonserver behind
    for server in list(_LIVE):
        server.stop()


class TritonServer:
    """One tritonserver process on 127.0.0.1 with free ports.

    ``with TritonServer(repo, work_dir) as server: ...`` or ``start()`` / ``stop()``.
    After ``start()``: ``grpc_url``/``http_url`` ("127.0.0.1:PORT", no scheme, as tritonclient
    wants), ``metrics_url`` (None unless ``metrics=True``), ``log_path``, ``pid``.

    ``model_control="explicit"`` (default) loads every model at start (``--load-model=*``) and
    allows :meth:`load_model` / :meth:`unload_model`; ``"poll"`` re-reads the repository every
    ``poll_secs``; ``"none"`` loads everything once.
    """

    def __init__(
        self,
        repository: Path,
        work_dir: Path,
        *,
        model_control: str = "explicit",
        poll_secs: int = 1,
        metrics: bool = False,
        ready_timeout: float = 60.0,
        stop_timeout: float = 15.0,
        exit_timeout_secs: int = 5,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        load_models: Sequence[str] = ("*",),
    ) -> None:
        if model_control not in ("explicit", "poll", "none"):
            raise ValueError(f"model_control must be explicit, poll or none, not {model_control!r}")
        self.repository = Path(repository).resolve()
        self.work_dir = Path(work_dir).resolve()
        self.model_control = model_control
        self.poll_secs = poll_secs
        self.metrics = metrics
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.exit_timeout_secs = exit_timeout_secs
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.load_models = list(load_models)  # explicit mode: what is loaded at start
        self.log_path = self.work_dir / "tritonserver.log"
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.shm_prefix = f"mmguard{os.getpid()}_{secrets.token_hex(4)}_"
        self._log_file: BinaryIO | None = None
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None
        self.start_failures: list[str] = []  # starts that died before ready and were retried

    # -- addresses -------------------------------------------------------------------------

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"127.0.0.1:{self.metrics_port}" if self.metrics_port else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def ensure_healthy(self, within_s: float = 20.0) -> str | None:
        """Restart the server (same ports) if it stopped answering /v2/health/ready within
        ``within_s``, or at once if its process has ended; returns what was wrong (with the
        log) when it had to, else None."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.is_running():
            if self._get_status("/v2/health/ready") == 200:
                return None
            time.sleep(0.2)
        if self.is_running():
            why = (f"tritonserver (pid {self.pid}) did not answer /v2/health/ready for "
                   f"{within_s:.0f} s; restarted on the same ports")
        else:
            why = self.ended_report()
        why += self._failure_report()
        self.stop()
        self.start(keep_ports=True)
        # A running mmguard's gRPC channel to it retries the connection on a backoff of up to
        # RECONNECT_BACKOFF_MAX_MS (+20 % jitter), failing calls fast meanwhile: a test that
        # starts at once would see the window, not mmguard's steady state.
        time.sleep(RECONNECT_BACKOFF_MAX_MS * 1.2 / 1000 + 0.3)
        return why

    def ended_report(self) -> str:
        """What to say of a server whose process ended on its own (the exit status, a signal
        by name)."""
        code = self.process.returncode if self.process is not None else None
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit status {code}")
        trace = self.crash_trace()
        return (f"tritonserver (pid {self.pid}) ended ({how}); restarted on the same ports"
                + (f"\nits crash trace:\n{trace}" if trace else ""))

    def crash_trace(self, lines: int = 30) -> str:
        """What Triton printed from its last ``Signal (N) received.`` on (its own backtrace of
        a crash), or "" when it printed none; the summary leads with it, before the log's tail
        (which a restart's own start-up lines fill)."""
        text = self.log_text().splitlines()
        starts = [i for i, line in enumerate(text) if line.startswith("Signal (")]
        return "\n".join(text[starts[-1]:starts[-1] + lines]) if starts else ""

    def restart_if_ended(self) -> str | None:
        """Start the server again (same ports) if its process has ended; cheap when it runs
        (no request is sent). Returns what happened, with the log, when it had to."""
        if self.process is None or self.is_running():
            return None
        return self.ensure_healthy(within_s=0)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, keep_ports: bool = False) -> Self:
        """Start; wait for ``/v2/health/ready`` == 200, else RuntimeError with the log tail.
        ``keep_ports``: restart on the ports of the previous start (a server that comes back)."""
        if self.is_running():
            return self
        paths = triton_paths()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        backends = self._prepare_backends(paths)
        began = time.monotonic()
        reuse = keep_ports and self.grpc_port is not None and self.http_port is not None
        attempts = 3
        for attempt in range(1, attempts + 1):
            if not reuse:
                ports = free_ports(3 if self.metrics else 2)
                self.grpc_port, self.http_port = ports[0], ports[1]
                self.metrics_port = ports[2] if self.metrics else None
            self._spawn(paths, backends)
            try:
                self._wait_ready()
            except RuntimeError as exc:
                tail = self.log_tail(40)
                died = self.process is not None and self.process.poll() is not None
                self.stop()
                port_clash = "already in use" in tail.lower() or "failed to bind" in tail.lower()
                # A Triton that dies while starting on a busy machine (seen: boost::interprocess
                # lock_exception, exit -6) is started again; the log file is appended to, so
                # every attempt's output stays in it.
                if (port_clash or died) and attempt < attempts:
                    self.start_failures.append(f"attempt {attempt}: {str(exc).splitlines()[0]}")
                    self._log_note(f"mmguard test fixture: start attempt {attempt} failed "
                                   f"({'port clash' if port_clash else 'died'}); retrying")
                    continue
                raise
            self.start_seconds = time.monotonic() - began
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """SIGTERM, wait ``stop_timeout``, SIGKILL; then SIGKILL what is left of its group."""
        proc = self.process
        if proc is None:
            return
        began = time.monotonic()
        pgid = proc.pid  # start_new_session=True: the server leads its own process group
        try:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        finally:
            self._kill_group(pgid)
            self._remove_shm_regions()
            self._log_file_close()
            self.process = None
            _LIVE.discard(self)
            self.stop_seconds = time.monotonic() - began

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _kill_group(self, pgid: int) -> None:
        deadline = time.monotonic() + 5
        while self._group_alive(pgid) and time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)

    def _remove_shm_regions(self) -> None:
        """Delete this server's Python-backend regions that a killed process left in /dev/shm."""
        for region in Path("/dev/shm").glob(self.shm_prefix + "*"):
            try:
                region.unlink()
            except OSError:
                pass

    # -- model repository API (explicit mode) ----------------------------------------------

    def load_model(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load ``name`` (explicit mode); ``config`` (model config as a JSON-able dict) overrides
        its config.pbtxt. Returns when the model is ready; RuntimeError with Triton's text if not.

        Trap: loading an already-loaded model reloads it only if its files changed (or a config
        is given). After an override, ``load_model(name)`` keeps the override; call
        ``unload_model(name)`` first to get config.pbtxt back.
        """
        body: dict[str, Any] = {}
        if config is not None:
            body = {"parameters": {"config": json.dumps(config)}}
        self._post(f"/v2/repository/models/{name}/load", body)

    def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        body = {"parameters": {"unload_dependents": unload_dependents}}
        self._post(f"/v2/repository/models/{name}/unload", body)

    def repository_index(self) -> list[dict[str, Any]]:
        index: list[dict[str, Any]] = json.loads(self._post("/v2/repository/index", {}))
        return index

    def model_ready(self, name: str) -> bool:
        return self._get_status(f"/v2/models/{name}/ready") == 200

    # -- logs -------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(deque(self.log_text().splitlines(), maxlen=lines))

    # -- internals --------------------------------------------------------------------------

    def _prepare_backends(self, paths: TritonPaths) -> Path:
        backends = self.work_dir / "backends"
        python_dir = backends / "python"
        if not (python_dir / "triton_python_backend_stub").is_file():
            shutil.copytree(
                paths.backends,
                backends,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            shutil.copy2(paths.stub, python_dir / "triton_python_backend_stub")
        return backends

    def _env(self, paths: TritonPaths) -> dict[str, str]:
        env = os.environ.copy()
        ld = [str(paths.python_libdir), str(paths.libs)]
        if env.get("LD_LIBRARY_PATH"):
            ld.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(ld)
        bin_dir = Path(sys.executable).parent
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("PYTHONHOME", None)
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        return env

    def _command(self, paths: TritonPaths, backends: Path) -> list[str]:
        cmd = [
            str(paths.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--backend-config=python,shm-default-byte-size=16777216",
            "--backend-config=python,shm-growth-byte-size=8388608",
            f"--model-control-mode={self.model_control}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            f"--model-load-thread-count={self._load_threads()}",
            f"--exit-timeout-secs={self.exit_timeout_secs}",
            f"--log-verbose={self.log_verbose}",
            "--pinned-memory-pool-byte-size=0",
            "--cuda-memory-pool-byte-size=0:0",
        ]
        if self.model_control == "explicit":
            cmd += [f"--load-model={name}" for name in self.load_models]
        elif self.model_control == "poll":
            cmd.append(f"--repository-poll-secs={self.poll_secs}")
        if self.metrics:
            cmd += [
                "--allow-metrics=true",
                "--allow-gpu-metrics=false",
                "--metrics-address=127.0.0.1",
                f"--metrics-port={self.metrics_port}",
            ]
        else:
            cmd.append("--allow-metrics=false")
        return cmd + self.extra_args

    def _load_threads(self) -> int:
        # Loading a Python model is mostly waiting on its stub process (~1.3 s each, little CPU),
        # so one thread per model: 12 models ready in ~3 s instead of ~4.6 s (4) or ~16 s (1).
        models = (
            sum(1 for p in self.repository.iterdir() if p.is_dir())
            if self.repository.is_dir()
            else 0
        )
        return min(16, max(4, models))

    def _spawn(self, paths: TritonPaths, backends: Path) -> None:
        self._log_file_close()
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115  (held while it runs)
        cmd = self._command(paths, backends)
        self._log_file.write(("+ " + " ".join(cmd) + "\n").encode())
        cmd = self._die_with_parent_prefix() + cmd
        self._log_file.flush()
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._env(paths),
            cwd=self.work_dir,
            start_new_session=True,
        )
        _LIVE.add(self)

    @staticmethod
    def _die_with_parent_prefix() -> list[str]:
        """``setpriv --pdeathsig TERM``: the server gets SIGTERM if this process dies (even by
        SIGKILL, where atexit never runs). Linux delivers it when the *thread* that forked exits,
        so it is only used when starting from the main thread."""
        setpriv = shutil.which("setpriv")
        if setpriv is None or threading.current_thread() is not threading.main_thread():
            return []
        return [setpriv, "--pdeathsig", "TERM", "--"]

    def _log_note(self, text: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(text + "\n")

    def _log_file_close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {code} before it was ready"
                    + self._failure_report()
                )
            if self._get_status("/v2/health/ready") == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tritonserver not ready after {self.ready_timeout:.0f} s"
                    + self._failure_report()
                )
            time.sleep(0.1)

    def _failure_report(self) -> str:
        """Error lines from the whole log (a failed load scrolls out of the tail), then the tail."""
        errors = [
            line
            for line in self.log_text().splitlines()
            if line.startswith("E") and "CudaDriverHelper" not in line
        ]
        report = ""
        if errors:
            report += "\nerror lines:\n" + "\n".join(errors[-20:])
        return report + f"\nlast 40 lines of {self.log_path}:\n{self.log_tail(40)}"

    def _url(self, path: str) -> str:
        return f"http://{self.http_url}{path}"

    def _get_status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self._url(path), timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    def _post(self, path: str, body: dict[str, Any]) -> str:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self._url(path), data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"POST {path} -> HTTP {exc.code}: {detail}") from exc
        except OSError as exc:  # a timeout included: say what Triton was doing
            raise RuntimeError(f"POST {path} failed: {exc!r}" + self._failure_report()) from exc

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        return f"<TritonServer grpc={self.grpc_url} http={self.http_url} {state}>"
