"""Shared memory under attack: one client must not read, overwrite or unregister another's
region, nor make mmguard open a file outside /dev/shm or one it does not own, nor crash mmguard
by cutting its own file while it is registered.

The victim and one attacker are separate processes running as other uids (65534 and 65533),
talking to a real ``mmguard serve`` over loopback with the standard library only; the test
process (root) is a second attacker. Starting them as other uids needs root, as in CI here.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ort_config
from tests.support.adversary import Prober, http_call, rss_mib, serve
from tests.support.process import MmguardProcess

VICTIM_UID, ATTACKER_UID = 65534, 65533
SECRET = [13.0, 37.0]

# The clients, stdlib only. Each HTTP call is a fresh connection: the namespace is the uid.
CLIENT = r'''
import http.client, json, os, struct, sys

PORT = int(sys.argv[1])

def call(method, path, doc=None):
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    conn.request(method, path, body=None if doc is None else json.dumps(doc))
    r = conn.getresponse()
    out = (r.status, r.read().decode())
    conn.close()
    return out

def infer(in_region=None, out_region=None):
    x = {"name": "INPUT0", "datatype": "FP32", "shape": [2]}
    if in_region:
        x["parameters"] = {"shared_memory_region": in_region, "shared_memory_byte_size": 8}
    else:
        x["data"] = [1.0, 2.0]
    doc = {"inputs": [x]}
    if out_region:
        doc["outputs"] = [{"name": "OUTPUT0", "parameters": {
            "shared_memory_region": out_region, "shared_memory_byte_size": 8}}]
    return call("POST", "/v2/models/identity_fp32/infer", doc)
'''

VICTIM = CLIENT + r'''
key = sys.argv[2]
fd = os.open("/dev/shm/" + key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.write(fd, struct.pack("<2f", 13.0, 37.0))
print(json.dumps(call("POST", "/v2/systemsharedmemory/region/victim/register",
                      {"key": "/" + key, "byte_size": 8})), flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        print(json.dumps({"status": call("GET", "/v2/systemsharedmemory/status"),
                          "infer": infer("victim"),
                          "bytes": list(struct.unpack("<2f", os.pread(fd, 8, 0)))}), flush=True)
    else:
        call("POST", "/v2/systemsharedmemory/unregister")
        os.unlink("/dev/shm/" + key)
        break
'''

ATTACKER = CLIENT + r'''
key = sys.argv[2]
print(json.dumps({
    "status_all": call("GET", "/v2/systemsharedmemory/status"),
    "status_victim": call("GET", "/v2/systemsharedmemory/region/victim/status"),
    "read_victim": infer(in_region="victim"),
    "write_victim": infer(out_region="victim"),
    "register_victim_key": call("POST", "/v2/systemsharedmemory/region/stolen/register",
                                {"key": "/" + key, "byte_size": 8}),
    "unregister_victim": call("POST", "/v2/systemsharedmemory/region/victim/unregister"),
    "unregister_all": call("POST", "/v2/systemsharedmemory/unregister"),
}), flush=True)
'''


@pytest.fixture(scope="module")
def shm_served(ort_models: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    config = ort_config(ort_models, shared_memory={"system": True})
    with serve(tmp_path_factory.mktemp("adversary_shm"), config) as proc:
        yield proc


def other_uid_python() -> str:
    """An interpreter another uid may run: the clients need only the standard library, and the
    project's may live under a home directory closed to other users."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if all(os.stat(d).st_mode & 0o001 for d in Path(real).parents) and \
                os.stat(real).st_mode & 0o001:
            return candidate
    raise AssertionError("no python3 that other users may run (needed to act as another uid)")


def as_uid(uid: int, script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([other_uid_python(), "-c", script, *args], user=uid, group=uid,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PATH": os.environ.get("PATH", "")}, cwd="/")


def ask(proc: subprocess.Popen[str], command: str | None = None) -> Any:
    assert proc.stdin is not None and proc.stdout is not None
    if command is not None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"client exited ({proc.wait(10)})"
    return json.loads(line)


def error(answer: list[Any]) -> str:
    return str(json.loads(answer[1])["error"])


def test_one_client_cannot_touch_another_clients_region(shm_served: MmguardProcess) -> None:
    port = shm_served.ports["http"]
    key = f"mmg_victim_{secrets.token_hex(4)}"
    before = rss_mib(shm_served.proc.pid)
    with as_uid(VICTIM_UID, VICTIM, str(port), key) as victim:
        attack(port, shm_served.ports["grpc"], key, victim)
    assert not Path("/dev/shm", key).exists()
    assert rss_mib(shm_served.proc.pid) - before < 50


def attack(port: int, grpc_port: int, key: str, victim: subprocess.Popen[str]) -> None:
    try:
        assert ask(victim)[0] == 200  # registered
        with Prober(port) as probes:
            with as_uid(ATTACKER_UID, ATTACKER, str(port), key) as other:
                seen = ask(other)
            # The test process, root, tries the same; the kernel would let root read the file
            # itself, but mmguard still lends nobody's memory only to nobody.
            root_read = http_call(port, "POST", "/v2/models/identity_fp32/infer", json.dumps(
                {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "parameters": {
                    "shared_memory_region": "victim", "shared_memory_byte_size": 8}}]}).encode())
            root_register = http_call(port, "POST", "/v2/systemsharedmemory/region/r/register",
                                      json.dumps({"key": "/" + key, "byte_size": 8}).encode())
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            with pytest.raises(InferenceServerException) as grpc_register:
                grpc.register_system_shared_memory("r", "/" + key, 8)
            grpc_status = grpc.get_system_shared_memory_status()
            grpc.close()
            check = ask(victim, "check")
        assert seen["status_all"] == [200, "[]"]
        assert seen["status_victim"][0] == 404
        for attempt in ("read_victim", "write_victim"):
            assert seen[attempt][0] == 404 and "'victim'" in error(seen[attempt]), seen[attempt]
        assert seen["register_victim_key"][0] == 403
        assert f"uid {VICTIM_UID}" in error(seen["register_victim_key"])
        assert f"uid {ATTACKER_UID}" in error(seen["register_victim_key"])
        assert seen["unregister_victim"][0] == 200 and seen["unregister_all"][0] == 200
        assert root_read[0] == 404 and root_register[0] == 403
        assert grpc_register.value.status() == "StatusCode.PERMISSION_DENIED"
        assert len(grpc_status.regions) == 0
        # The victim's region survived every attempt: still listed, still read, still intact.
        assert [r["name"] for r in json.loads(check["status"][1])] == ["victim"]
        assert check["infer"][0] == 200
        assert json.loads(check["infer"][1])["outputs"][0]["data"] == SECRET
        assert check["bytes"] == SECRET
        probes.assert_served(minimum=1)
    finally:
        if victim.poll() is None:
            assert victim.stdin is not None
            victim.stdin.write("quit\n")
            victim.stdin.flush()
            victim.wait(30)


def register(port: int, name: str, key: str, size: int) -> tuple[int, str]:
    status, _, body = http_call(port, "POST", f"/v2/systemsharedmemory/region/{name}/register",
                                json.dumps({"key": key, "byte_size": size}).encode())
    return status, body.decode()


def test_keys_cannot_leave_dev_shm(shm_served: MmguardProcess) -> None:
    port = shm_served.ports["http"]
    secret = Path("/etc/hostname").read_bytes()[:8] or b"x"
    link = Path("/dev/shm", f"mmg_link_{secrets.token_hex(4)}")
    link.symlink_to("/etc/hostname")
    try:
        with Prober(port) as probes:
            for key in ("../etc/hostname", "/../etc/hostname", "/etc/hostname", "/."):
                status, body = register(port, "escape", key, 1)
                assert status == 400 and "must name one file" in body, (key, body)
            status, body = register(port, "escape", "/" + link.name, 1)
            assert status == 500 and "symbolic links" in body, body
            assert secret.decode(errors="replace") not in body
            status, _, listed = http_call(port, "GET", "/v2/systemsharedmemory/status")
        assert status == 200 and json.loads(listed) == []
        probes.assert_served(minimum=1)
    finally:
        link.unlink()


def test_a_client_cutting_its_own_file_does_not_crash_mmguard(
        shm_served: MmguardProcess) -> None:
    port = shm_served.ports["http"]
    path = Path("/dev/shm", f"mmg_cut_{secrets.token_hex(4)}")
    path.write_bytes(struct.pack("<2f", 1.0, 2.0) + b"\0" * 4096)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2],
                                   "parameters": {"shared_memory_region": "cut",
                                                  "shared_memory_byte_size": 8,
                                                  "shared_memory_offset": 4096}}]}).encode()
    try:
        assert register(port, "cut", "/" + path.name, 4104)[0] == 200
        with Prober(port) as probes:
            os.truncate(path, 0)  # a mapped read of it now would be SIGBUS
            status, _, answer = http_call(port, "POST", "/v2/models/identity_fp32/infer", body)
        assert status == 400 and "cut after registration" in answer.decode()
        assert shm_served.proc.poll() is None
        probes.assert_served(minimum=1)
    finally:
        http_call(port, "POST", "/v2/systemsharedmemory/region/cut/unregister")
        path.unlink()
