"""Device choice of the ONNX Runtime backend: CPU when asked or when CUDA is not there; a
clear refusal when CUDA is demanded and cannot load (never a silent CPU fallback)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from proxy.backends.onnxruntime import OnnxRuntimeBackend
from proxy.config.backends import OnnxRuntimeBackendConfig
from proxy.errors import ProxyError
from tests.support.models import write_identity


def backend(tmp_path: Path, device: str) -> OnnxRuntimeBackend:
    write_identity(tmp_path, "FP32")
    return OnnxRuntimeBackend(OnnxRuntimeBackendConfig(kind="onnxruntime", name="ort",
                                                      model_dir=tmp_path, device=device))


async def test_auto_and_cpu_load_what_is_really_there(tmp_path: Path) -> None:
    for device in ("auto", "cpu"):
        b = backend(tmp_path, device)
        await b.start()
        expected = "CUDAExecutionProvider" in ort.get_available_providers() and device == "auto"
        assert ("CUDAExecutionProvider" in b.providers) is expected
        assert b.providers[-1] == "CPUExecutionProvider"
        await b.close()


async def test_cuda_demanded_loads_cuda_or_is_refused_clearly(tmp_path: Path) -> None:
    b = backend(tmp_path, "cuda")
    if "CUDAExecutionProvider" in ort.get_available_providers():  # the gpu extra, on a GPU
        await b.start()
        assert b.providers[0] == "CUDAExecutionProvider"
    else:
        with pytest.raises(ProxyError, match="device 'cuda' asked for, but onnxruntime offers"):
            await b.start()
    await b.close()
