"""Command-line tools a test runs that no Python package ships, found or installed once.

The README's test command must pass on a fresh machine without ``scripts/ci_ops.sh`` having
run first (CI runs it before the suite; a developer may not), so a test that needs such a tool
asks here: it is taken from ``PATH``, or installed from Debian's packages the way
``scripts/ci_ops.sh`` installs it, with what the installer said kept for the failure message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

_LOCK = threading.Lock()


def promtool() -> str:
    """The path of ``promtool`` (Debian's ``prometheus`` package)."""
    return _tool("promtool", "prometheus")


def _tool(command: str, package: str) -> str:
    with _LOCK:
        found = shutil.which(command)
        if found is not None:
            return found
        apt = shutil.which("apt-get")
        if apt is None or os.geteuid() != 0:
            raise RuntimeError(f"{command} is not on PATH and cannot be installed here (needs "
                               f"root and apt-get): install the '{package}' package")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        said = []
        for step in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", package]):
            done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=600,
                                  stdin=subprocess.DEVNULL)
            said.append(f"$ {' '.join(step)} -> {done.returncode}\n{done.stdout[-2000:]}"
                        f"{done.stderr[-2000:]}")
            if done.returncode != 0:
                break
        found = shutil.which(command)
        if found is None:
            raise RuntimeError(f"{command} could not be installed from '{package}':\n"
                               + "\n".join(said))
        return found
