"""Client regions over a server's life: held open while registered, closed on unregister-all,
and closed when mmguard stops with regions still registered; CUDA shared memory refused with
its reason on both fronts. mmguard runs in this process, so its open files are ours to read."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard


def opened(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    fds = [fd for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()]
    return sum(1 for fd in fds if os.path.realpath(fd) == path)


def test_regions_are_closed_on_unregister_and_on_stop(ort_models: Path) -> None:
    key = f"mmg_life_{secrets.token_hex(4)}"
    handle = shm.create_shared_memory_region(key, "/" + key, 8)
    try:
        shm.set_shared_memory_region(handle, [np.array([1.5, -2.0], np.float32)])
        path = "/dev/shm/" + key
        own = opened(path)  # the client library's own descriptor
        with RunningMmguard(ort_config(ort_models, shared_memory={"system": True})) as proxy:
            proxy.wait_ready()
            client = grpcclient.InferenceServerClient(proxy.grpc_url)
            client.register_system_shared_memory("a", "/" + key, 8)
            client.register_system_shared_memory("b", "/" + key, 8)
            assert opened(path) == own + 2
            x = grpcclient.InferInput("INPUT0", [2], "FP32")
            x.set_shared_memory("a", 8)
            np.testing.assert_array_equal(client.infer("identity_fp32", [x]).as_numpy("OUTPUT0"),
                                          [1.5, -2.0])
            client.unregister_system_shared_memory()
            assert opened(path) == own
            client.register_system_shared_memory("c", "/" + key, 8)
            client.close()
            assert opened(path) == own + 1
        assert opened(path) == own  # stopped with "c" registered: closed
    finally:
        shm.destroy_shared_memory_region(handle)


def test_cuda_shared_memory_is_refused_with_its_reason(ort_models: Path) -> None:
    with RunningMmguard(ort_config(ort_models, shared_memory={"system": True})) as proxy:
        proxy.wait_ready()
        g = grpcclient.InferenceServerClient(proxy.grpc_url)
        h = httpclient.InferenceServerClient(proxy.http_url)
        try:
            for register, code in ((g.register_cuda_shared_memory, "StatusCode.UNIMPLEMENTED"),
                                   (h.register_cuda_shared_memory, "501")):
                with pytest.raises(InferenceServerException) as info:
                    register("c", b"\x00" * 64, 0, 64)
                assert info.value.status() == code
                assert "CUDA IPC" in info.value.message()
            assert len(g.get_cuda_shared_memory_status().regions) == 0
            assert h.get_cuda_shared_memory_status() == []
            g.unregister_cuda_shared_memory()
            h.unregister_cuda_shared_memory()
        finally:
            g.close()
            h.close()
