"""LiteLLM's proxy as the Python peer in ``python -m bench.openai``: installed in its own venv by
the bench, started in front of the same vLLM as mmguard, stopped with the rest.

Why its own venv: ``litellm[proxy]`` pins its own FastAPI, uvicorn, pydantic and OpenAI SDK
versions; in mmguard's venv it would change what the tests run against.

What runs: ``<venv>/bin/litellm --config <root>/litellm.yaml --host 127.0.0.1 --port P
--num_workers 1`` (one process, one event loop, as mmguard), ``LITELLM_MASTER_KEY`` set (the
client sends it as ``Authorization: Bearer``), no database, the local model-cost map (the
machine has no network), log level ERROR. One model ``tiny-llama`` → ``hosted_vllm/tiny-llama``
at vLLM's ``/v1``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, free_ports, http_status, pdeathsig, stop_process

DEFAULT_VENV = ROOT / "bench" / ".venv-litellm"
REQUIREMENT = "litellm[proxy]"
# Imported to tell an installed proxy from a half-made venv: the proxy extra's own modules.
PROBE = ("import importlib.metadata as m, litellm.proxy.proxy_server; "
         "print(m.version('litellm'))")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_commands(venv: Path, base_python: str = sys.executable) -> list[list[str]]:
    """The commands that make the venv and install LiteLLM's proxy into it (from the
    registry pip is configured for)."""
    py = str(venv_python(venv))
    return [[base_python, "-m", "venv", str(venv)],
            [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             REQUIREMENT]]


def installed_version(venv: Path, timeout: float = 120.0) -> str | None:
    """LiteLLM's version when its proxy imports in ``venv``, else None."""
    py = venv_python(venv)
    if not py.is_file() or not (venv / "bin" / "litellm").is_file():
        return None
    try:
        out = subprocess.run([str(py), "-c", PROBE], capture_output=True, timeout=timeout,
                             env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.decode(errors="replace").strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else None


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of a tool's output, cut to ``limit`` (for a one-line reason)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:limit]


def ensure_installed(venv: Path, log: Path, timeout: float = 1200.0) -> tuple[str | None, str]:
    """(version, "") once LiteLLM's proxy is installed in ``venv`` (installing it if needed),
    or (None, why not) in one line."""
    version = installed_version(venv)
    if version:
        return version, ""
    print(f"installing {REQUIREMENT} into {venv} (once; a few minutes) ...", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    for cmd in install_commands(venv):
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{' '.join(cmd[:4])}: {exc}"
        with open(log, "ab") as f:
            f.write(done.stdout + done.stderr)
        if done.returncode != 0:
            return None, (f"{' '.join([Path(cmd[0]).name, *cmd[1:4]])} exited "
                          f"{done.returncode}: "
                          f"{last_line(done.stderr.decode(errors='replace'))}")
    version = installed_version(venv)
    if not version:
        return None, f"installed, but litellm.proxy does not import in {venv}"
    return version, ""


def proxy_config(model: str, vllm_url: str) -> dict[str, Any]:
    """LiteLLM's proxy config: ``model`` served by vLLM at ``vllm_url`` (its OpenAI API).
    The master key comes from the environment (``LITELLM_MASTER_KEY``), not the file."""
    return {
        "model_list": [{"model_name": model,
                        "litellm_params": {"model": f"hosted_vllm/{model}",
                                           "api_base": f"{vllm_url.rstrip('/')}/v1",
                                           "api_key": "none"}}],
        "litellm_settings": {"drop_params": False, "telemetry": False},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }


class LitellmProcess:
    """LiteLLM's proxy as a child process (its own session, so its whole group is stopped and
    its CPU counted). Ready when ``GET /health/liveliness`` answers 200."""

    def __init__(self, venv: Path, root: Path, model: str, vllm_url: str) -> None:
        self.venv = venv
        self.root = root
        self.config = proxy_config(model, vllm_url)
        self.config_path = root / "litellm.yaml"
        self.log_path = root / "litellm.log"
        self.master_key = "sk-bench-" + secrets.token_hex(8)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config, indent=2) + "\n")  # JSON is YAML

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 180.0) -> None:
        (self.port,) = free_ports(1)
        env = {**os.environ, "LITELLM_MASTER_KEY": self.master_key,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "PYTHONUNBUFFERED": "1"}
        for var in ("DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(var, None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed below, the child keeps it
        try:
            self.proc = subprocess.Popen(
                [str(self.venv / "bin" / "litellm"), "--config", str(self.config_path),
                 "--host", "127.0.0.1", "--port", str(self.port), "--num_workers", "1"],
                cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=pdeathsig)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if http_status(f"{self.url}/health/liveliness") == 200:
                return
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"LiteLLM's proxy did not become ready; log tail:\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        stop_process(self.proc, signal.SIGTERM, timeout=15)
        try:
            os.killpg(pgid, signal.SIGKILL)  # anything it started and left behind
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None
