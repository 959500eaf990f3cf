#!/usr/bin/env bash
# One-command GPU check of worker scaling (issue #18 item 3), for a 16-core NVIDIA machine; about
# 3-5 minutes. From the repository root:
#
#   scripts/gpu_check.sh [--cpu] [--workers-list 1,4,8] [--triton] [--duration S]
#
# 1. a venv ($MMGUARD_GPU_VENV, default /tmp/mmguard-gpu-venv) with `pip install -e '.[gpu]'`
#    (onnxruntime-gpu; not '.[gpu,test]': the test extra pulls the CPU onnxruntime, and both
#    together hide CUDA, plus a 2 GB torch). Offline (no package index answers): a venv that
#    sees the interpreter's own packages, the wheels in $MMGUARD_WHEELS if set, and mmguard
#    itself installed without dependencies; what is still missing is named
#    (MMGUARD_GPU_OFFLINE=1 takes this path whatever the network).
# 2. scripts/gpu_check.py providers: ONNX Runtime offers CUDAExecutionProvider and a session
#    really runs on it (identity model, bytes compared).
# 3. scripts/gpu_check.py mmguard: `mmguard serve` with an onnxruntime backend at device cuda,
#    one gRPC and one HTTP answer byte-checked, the providers line read from its log.
# 4. python -m bench.workers --ort-device cuda --workers-list 1,4,8 (--triton: also the real
#    Triton rows, when nvidia-pytriton installs).
# Results go to $OUT when set (the device tool collects it), else bench/out: workers.json,
# workers.md, gpu_check.log, gpu_check_mmguard.log. Any failure: one line "GPU CHECK FAILED:
# ..." and exit 1. --cpu runs the same on the CPU provider (no CUDA check; for a machine with no
# GPU), e.g. `scripts/gpu_check.sh --cpu --workers-list 1`.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

cpu=0 triton=0 workers=1,4,8 duration=5
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) cpu=1 ;;
    --triton) triton=1 ;;
    --workers-list) workers=$2; shift ;;
    --duration) duration=$2; shift ;;
    *) echo "usage: $0 [--cpu] [--workers-list 1,4,8] [--triton] [--duration S]" >&2; exit 2 ;;
  esac
  shift
done

out=${OUT:-$repo/bench/out}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
began=$SECONDS
fail() { echo "GPU CHECK FAILED: $*"; exit 1; }
step() { echo "== [$((SECONDS - began))s] $*"; }

py=${PYTHON:-python3}
command -v "$py" >/dev/null || fail "no $py on PATH (set PYTHON=...)"
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "Python $pyver: mmguard needs 3.11"
step "machine: $(nproc) CPUs, Python $pyver ($py)"
if [ "$cpu" = 0 ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader || echo "(no nvidia-smi)"
fi

# -- 1. the venv -----------------------------------------------------------------------------
venv=${MMGUARD_GPU_VENV:-/tmp/mmguard-gpu-venv}
extra=$([ "$cpu" = 1 ] && echo cpu || echo gpu)
ort_dist=$([ "$cpu" = 1 ] && echo onnxruntime || echo onnxruntime-gpu)
pip_flags=(-q --disable-pip-version-check)
isolated=0
# mmguard declares 3.11 only; a newer interpreter (the GPU image's is 3.12) is tried anyway
[ "$pyver" = 3.11 ] || pip_flags+=(--ignore-requires-python)
if [ -z "${MMGUARD_GPU_OFFLINE:-}" ] \
    && timeout 60 "$py" -m pip index versions "$ort_dist" --retries 0 --timeout 10 >/dev/null 2>&1
then
  step "venv $venv: pip install -e '.[$extra]' (package index reachable)"
  isolated=1
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || fail "could not create the venv $venv"
  timeout 240 "$venv/bin/pip" install "${pip_flags[@]}" -e ".[$extra]" \
    || fail "pip install -e '.[$extra]' failed (output above)"
  if [ "$triton" = 1 ]; then
    timeout 120 "$venv/bin/pip" install "${pip_flags[@]}" nvidia-pytriton==0.7.0 \
      || echo "nvidia-pytriton did not install: the Triton rows will be skipped"
  fi
else
  step "venv $venv: no package index answers; the interpreter's own packages" \
       "${MMGUARD_WHEELS:+, wheels from $MMGUARD_WHEELS}, mmguard without dependencies"
  [ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv" \
    || fail "could not create the venv $venv"
  if [ -n "${MMGUARD_WHEELS:-}" ]; then
    timeout 120 "$venv/bin/pip" install "${pip_flags[@]}" --no-index --find-links "$MMGUARD_WHEELS" \
      "$MMGUARD_WHEELS"/*.whl || fail "installing the wheels in $MMGUARD_WHEELS failed"
  fi
  timeout 120 "$venv/bin/pip" install "${pip_flags[@]}" --no-index --no-deps --no-build-isolation \
    -e . || fail "pip install --no-deps -e . failed offline (setuptools>=69 must be installed)"
fi
vpy=$venv/bin/python
missing=$("$vpy" - <<'EOF'
import importlib.util
need = ["grpc", "aiohttp", "numpy", "onnx", "onnxruntime", "pydantic", "yaml", "google.protobuf",
        "tritonclient.grpc", "prometheus_client", "opentelemetry.sdk", "grpc_health", "PIL"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None
               or (("." in m) and importlib.util.find_spec(m) is None)))
EOF
)
[ -z "$missing" ] || fail "the venv lacks Python modules: $missing (offline: carry their wheels in \$MMGUARD_WHEELS)"
# (offline the venv sees the interpreter's packages, where its own onnxruntime-gpu wheel shadows
# a CPU onnxruntime; in an isolated venv the two would overwrite each other's files)
if [ "$cpu" = 0 ] && [ "$isolated" = 1 ] && "$vpy" -m pip show onnxruntime >/dev/null 2>&1 \
    && "$vpy" -m pip show onnxruntime-gpu >/dev/null 2>&1; then
  fail "both onnxruntime and onnxruntime-gpu are installed in $venv: CUDA hides behind the CPU build; pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"
fi

# CUDA and cuDNN libraries that pip packages bring (nvidia-*): on the loader's path for mmguard,
# which opens its sessions without onnxruntime.preload_dlls()
nvidia_libs() {
  "$vpy" - <<'EOF'
import glob, os, site
dirs = [p for s in site.getsitepackages() + [site.getusersitepackages()]
        for p in glob.glob(os.path.join(s, "nvidia", "*", "lib"))]
print(":".join(dict.fromkeys(dirs)))
EOF
}
base_ld=${LD_LIBRARY_PATH:-}
set_ld() {
  local libs
  libs=$(nvidia_libs)
  export LD_LIBRARY_PATH="$libs${base_ld:+${libs:+:}$base_ld}"
}
set_ld
export PYTHONPATH=$repo PYTHONUNBUFFERED=1

# -- 2, 3. ONNX Runtime's provider, mmguard on it ----------------------------------------------
cpuflag=$([ "$cpu" = 1 ] && echo --cpu || true)
step "ONNX Runtime's providers"
if ! timeout 120 "$vpy" scripts/gpu_check.py providers $cpuflag; then
  # the CUDA provider's library loads only where the CUDA and cuDNN it was built for are found:
  # the wheel's extras bring them as nvidia-* packages (some GB: past the 5 minutes)
  [ "$cpu" = 0 ] && [ "$isolated" = 1 ] || fail "ONNX Runtime check (line above)"
  step "installing onnxruntime-gpu[cuda,cudnn] (CUDA and cuDNN libraries) and trying again"
  timeout 240 "$venv/bin/pip" install "${pip_flags[@]}" "onnxruntime-gpu[cuda,cudnn]" \
    || fail "pip install 'onnxruntime-gpu[cuda,cudnn]' failed (output above)"
  set_ld
  timeout 120 "$vpy" scripts/gpu_check.py providers || fail "ONNX Runtime check (line above)"
fi
step "mmguard with an onnxruntime backend on device $([ "$cpu" = 1 ] && echo cpu || echo cuda)"
timeout 150 "$vpy" scripts/gpu_check.py mmguard $cpuflag --out "$out" \
  || fail "mmguard on ONNX Runtime (line above)"

# -- 4. the worker-scaling matrix ---------------------------------------------------------------
backends=$([ "$triton" = 1 ] && echo ort,triton || echo ort)
step "bench.workers --workers-list $workers --backends $backends"
timeout 420 "$vpy" -m bench.workers --workers-list "$workers" --backends "$backends" \
  --ort-device "$([ "$cpu" = 1 ] && echo cpu || echo cuda)" --duration "$duration" \
  --warmup 1 --out "$out" || fail "bench.workers exited with $? (its lines above)"
step "done: $out/workers.md"
cat "$out/workers.md"
echo "GPU CHECK OK ($((SECONDS - began)) s)"
