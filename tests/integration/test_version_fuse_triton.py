"""The version fuse sees a Triton model's tokenizer and processor files: their SHA-256 joins the
fingerprint where the operator declares them (``fingerprint_files``), so a changed tokenizer.json
beside an unchanged model config fuses the route (503 / UNAVAILABLE with both fingerprints),
and the route rejoins once the file is back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer
from tests.support.wire import grpc_infer_raw, grpc_request

BODY = grpc_request("fused", [("x", "FP32", [1, 16], b"\0" * 64)])


def until(cond: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError("condition never held")


def refused(url: str) -> bool:
    try:
        grpc_infer_raw(url, BODY)
        return False
    except grpc.RpcError:
        return True


@pytest.mark.triton
def test_a_changed_tokenizer_file_fuses_the_route(triton: TritonServer, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": {"type": "BPE", "merges": ["a b"]}}')
    backend: dict[str, Any] = {"kind": "triton_grpc", "name": "triton", "url": triton.grpc_url}
    probe = {"name": "probe", "backend": "triton", "backend_model": "small_fp32"}
    with RunningMmguard({"backends": [backend], "models": [probe]}) as m:
        m.wait_ready(timeout=60)
        plain = m.server.plane.runtime.contracts["probe"].fingerprint  # type: ignore[union-attr]
    backend["fingerprint_files"] = {"small_fp32": [str(tokenizer)]}
    with RunningMmguard({"backends": [backend], "models": [probe]}) as m:
        m.wait_ready(timeout=60)
        good = m.server.plane.runtime.contracts["probe"].fingerprint  # type: ignore[union-attr]
    assert good != plain  # the file is in it
    cfg = {"backends": [backend], "contract_refresh_s": 0.2,
           "models": [{"name": "fused", "backend": "triton", "backend_model": "small_fp32",
                       "filters": [{"fallback": {"expect_fingerprint": {"fused": good},
                                                 "cache": None}}]}]}
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        assert grpc_infer_raw(m.grpc_url, BODY)[0]
        tokenizer.write_text('{"model": {"type": "BPE", "merges": []}}')  # another tokenizer
        until(lambda: refused(m.grpc_url))
        with pytest.raises(grpc.RpcError) as exc:
            grpc_infer_raw(m.grpc_url, BODY)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        actual = m.server.plane.runtime.contracts["fused"].fingerprint  # type: ignore[union-attr]
        assert actual != good
        assert good in exc.value.details() and actual in exc.value.details()
        tokenizer.write_text('{"model": {"type": "BPE", "merges": ["a b"]}}')
        until(lambda: not refused(m.grpc_url))  # the same file again: it rejoins
