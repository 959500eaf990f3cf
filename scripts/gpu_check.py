"""The checks ``scripts/gpu_check.sh`` runs before the worker-scaling bench (issue #18 item 3).

    python scripts/gpu_check.py providers [--cpu]
    python scripts/gpu_check.py mmguard [--cpu] [--out DIR]

``providers``: ONNX Runtime offers CUDAExecutionProvider, a session really loads it (not a
silent fall-back to the CPU) and an identity model's answer on it is the input, byte for byte.
``mmguard``: ``mmguard serve`` with an ``onnxruntime`` backend at ``device: cuda`` (mmguard
refuses to start when CUDA does not load) answers one gRPC and one HTTP request with the input's
exact bytes, and its log names the providers it loaded. ``--cpu``: the same on the CPU provider
(for a machine with no GPU). Every failure ends with one line starting ``FAIL:`` and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root, for bench and tests
    sys.path.insert(0, str(ROOT))
from bench.common import MmguardProcess  # noqa: E402
from bench.proxy.cases import CASES, GRPC_INFER, ORT_IN, ORT_OUT, MiB  # noqa: E402
from bench.proxy.servers import write_ort_models  # noqa: E402
from bench.proxy.wire import (  # noqa: E402
    grpc_check,
    grpc_request,
    http_check,
    http_request,
    payload,
)

PIXEL = CASES[0]
CUDA = "CUDAExecutionProvider"


def _spec(addr: str) -> dict[str, Any]:
    return {"addr": addr, "model": PIXEL.ort_model, "shape": list(PIXEL.shape),
            "input": ORT_IN, "output": ORT_OUT, "op": "identity"}


def check_providers(cpu: bool) -> str:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if not cpu and CUDA not in available:
        raise SystemExit(f"FAIL: onnxruntime {ort.__version__} offers {available}, no {CUDA}: "
                         f"install onnxruntime-gpu (and never onnxruntime beside it)")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_ort_models(Path(tmp))[PIXEL.ort_model]
        want = ["CPUExecutionProvider"] if cpu else [CUDA, "CPUExecutionProvider"]
        session = ort.InferenceSession(str(path), providers=want)
        loaded = session.get_providers()
        if not cpu and loaded[0] != CUDA:
            raise SystemExit(f"FAIL: a session asked for {want} loaded {loaded}: CUDA's "
                             f"libraries did not load (see the onnxruntime warning above)")
        x, expected = payload(_spec(""))
        got = session.run([ORT_OUT], {ORT_IN: x})[0]
        if got.tobytes() != expected:
            raise SystemExit(f"FAIL: the identity model on {loaded[0]} changed the bytes")
    return f"onnxruntime {ort.__version__}: available {available}; a session loaded {loaded}"


async def _ask(grpc_addr: str, http_addr: str) -> None:
    import aiohttp
    import grpc

    spec = _spec(grpc_addr)
    x, expected = payload(spec)
    opts = [("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB)]
    async with grpc.aio.insecure_channel(grpc_addr, options=opts) as channel:
        call = channel.unary_unary(GRPC_INFER)
        grpc_check(spec, await call(grpc_request(spec, x), timeout=60), expected)
    body, headers = http_request(spec, x)
    async with aiohttp.ClientSession(auto_decompress=False) as session, session.post(
            f"http://{http_addr}/v2/models/{spec['model']}/infer", data=body,
            headers=headers) as r:
        http_check(spec, r.status, r.headers, await r.read(), expected)


def _providers_in(line: str) -> Any:
    """The providers list of mmguard's JSON log line (the whole line if it is not JSON)."""
    try:
        return json.loads(line).get("providers") or line.strip()[-200:]
    except ValueError:
        return line.strip()[-200:]


def check_mmguard(cpu: bool, out: Path | None) -> str:
    device = "cpu" if cpu else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_ort_models(root / "models")
        (root / "mmguard").mkdir()
        mm = MmguardProcess(root / "mmguard", {
            "listeners": {"http": {"host": "127.0.0.1"}, "grpc": {"host": "127.0.0.1"},
                          "admin": {"host": "127.0.0.1"}},
            "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(root / "models"),
                          "models": [PIXEL.ort_model], "device": device}],
            "models": [{"name": PIXEL.ort_model, "backend": "ort"}],
            # info: the line naming the providers each model loaded with
            "telemetry": {"log_level": "info"}, "shutdown_grace_s": 1.0})
        try:
            try:
                mm.start(attempts=1, timeout=90)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)  # the log's tail
                why = [ln for ln in str(exc).splitlines() if "failed to start" in ln]
                raise SystemExit(f"FAIL: mmguard with an onnxruntime backend at device "
                                 f"'{device}' was not ready in 90 s"
                                 + (f"; last: {why[-1][-300:]}" if why else "")) from None
            try:
                asyncio.run(_ask(f"127.0.0.1:{mm.ports['grpc']}",
                                 f"127.0.0.1:{mm.ports['http']}"))
            except AssertionError as exc:
                raise SystemExit(f"FAIL: mmguard's answer on device '{device}': {exc}") from None
        finally:
            mm.stop()
            log = mm.log_path.read_text(errors="replace")
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / "gpu_check_mmguard.log").write_text(log[-200_000:])
        lines = [ln for ln in log.splitlines() if "with providers" in ln]
        if not lines or (not cpu and CUDA not in lines[0]):
            raise SystemExit(f"FAIL: mmguard's log does not show {CUDA if not cpu else 'the'} "
                             f"provider loaded: {lines[:1] or 'no providers line'}")
    return (f"mmguard on device '{device}': gRPC and HTTP answers byte-identical to the input; "
            f"its log: model {PIXEL.ort_model!r} loaded with providers "
            f"{_providers_in(lines[0])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("providers", "mmguard"))
    p.add_argument("--cpu", action="store_true", help="the CPU provider: no CUDA needed")
    p.add_argument("--out", type=Path, help="keep mmguard's log here")
    args = p.parse_args(argv)
    if args.what == "providers":
        print("OK: " + check_providers(args.cpu), flush=True)
    else:
        print("OK: " + check_mmguard(args.cpu, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
