"""TLS and mutual TLS on every listener and to the backends, with certificates made here.

The fronts are checked with the clients people use (tritonclient gRPC and HTTP, aiohttp,
urllib); the backends with a real TLS peer: a second mmguard whose fronts terminate (m)TLS and
speak the real v2 protocol. A certificate rotated on disk is served after SIGHUP.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import shutil
import signal
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from proxy.cli.main import main as cli_main
from proxy.config.model import ConfigError, parse_config
from tests.conftest import ort_config
from tests.support.mmguard import RunningMmguard
from tests.support.process import MmguardProcess

# --- a small PKI, made per module -----------------------------------------------------------

_NOW = datetime.datetime.now(datetime.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _ca(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key, subject = _key(), x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - datetime.timedelta(minutes=5))
            .not_valid_after(_NOW + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], name: str,
          server: bool) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_key, ca_cert = ca
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(_NOW - datetime.timedelta(minutes=5))
               .not_valid_after(_NOW + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    dir: Path
    serials: dict[str, int]

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def make_pki(root: Path) -> Pki:
    """ca, other-ca (unrelated); server and server2 (both by ca, for 127.0.0.1 and localhost);
    client (by ca), other-client (by other-ca)."""
    root.mkdir(parents=True, exist_ok=True)
    ca, other = _ca("mmguard test CA"), _ca("unrelated CA")
    made = {"ca": ca, "other-ca": other,
            "server": _leaf(ca, "server", True), "server2": _leaf(ca, "server2", True),
            "client": _leaf(ca, "client", False),
            "other-client": _leaf(other, "other-client", False)}
    for name, (key, cert) in made.items():
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return Pki(root, {name: cert.serial_number for name, (_, cert) in made.items()})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- helpers ----------------------------------------------------------------------------------


def tls_block(pki: Pki, server: str = "server", mtls: bool = True,
              files: Path | None = None) -> dict[str, Any]:
    """A listener's ``tls``; ``files`` = a folder with copies (for rotation)."""
    cert, key, ca = pki.cert(server), pki.key(server), pki.cert("ca")
    if files is not None:
        files.mkdir(exist_ok=True)
        cert, key, ca = (Path(shutil.copy(p, files / n)) for p, n in
                         ((cert, "listener.pem"), (key, "listener.key"), (ca, "clients-ca.pem")))
    block: dict[str, Any] = {"cert_file": str(cert), "key_file": str(key)}
    if mtls:
        block["client_ca_file"] = str(ca)
    return block


def tls_config(models: Path, pki: Pki, mtls: bool = True,
               files: Path | None = None) -> dict[str, Any]:
    cfg = ort_config(models)
    cfg["models"] = [{"name": "identity_fp32", "backend": "ort"}]
    block = tls_block(pki, mtls=mtls, files=files)
    cfg["listeners"] = {"http": {"tls": block}, "grpc": {"tls": block}, "admin": {"tls": block}}
    return cfg


def client_ssl(pki: Pki, ca: str = "ca", client: str | None = "client",
               alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.cert(ca)))
    if client is not None:
        ctx.load_cert_chain(pki.cert(client), pki.key(client))
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def grpc_client(url: str, pki: Pki, ca: str = "ca",
                client: str | None = "client") -> grpcclient.InferenceServerClient:
    kw = {} if client is None else {"private_key": str(pki.key(client)),
                                    "certificate_chain": str(pki.cert(client))}
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(pki.cert(ca)),
                                            **kw)


def identity(client: Any, model: str = "identity_fp32", mod: Any = grpcclient) -> NDArray[Any]:
    x = mod.InferInput("INPUT0", [3], "FP32")
    x.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    kw = {"client_timeout": 10} if mod is grpcclient else {}
    out: NDArray[Any] | None = client.infer(model, [x], **kw).as_numpy("OUTPUT0")
    assert out is not None
    return out


def peer_serial(port: int, pki: Pki, client: str = "client", grpc_port: bool = False) -> int:
    """The serial of the certificate a new connection to ``port`` is shown."""
    ctx = client_ssl(pki, client=client, alpn=["h2"] if grpc_port else None)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        der = conn.getpeercert(binary_form=True)
        if not grpc_port:  # a full exchange proves the client certificate was accepted
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(9) == b"HTTP/1.1 "
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def https_get(url: str, ctx: ssl.SSLContext) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
        return r.status, r.read()


# --- fronts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls_proxy(pki: Pki, ort_models: Path) -> Iterator[RunningMmguard]:
    with RunningMmguard(tls_config(ort_models, pki)) as m:
        m.wait_ready()
        yield m


def test_grpc_front_serves_tritonclient_over_mutual_tls(mtls_proxy: RunningMmguard,
                                                        pki: Pki) -> None:
    client = grpc_client(mtls_proxy.grpc_url, pki)
    assert client.is_model_ready("identity_fp32")
    np.testing.assert_array_equal(identity(client), [1, 2, 3])
    client.close()


def test_http_front_serves_tritonclient_aiohttp_and_urllib_over_mutual_tls(
        mtls_proxy: RunningMmguard, pki: Pki) -> None:
    client = httpclient.InferenceServerClient(mtls_proxy.http_url, ssl=True, ssl_options={
        "ca_certs": str(pki.cert("ca")), "certfile": str(pki.cert("client")),
        "keyfile": str(pki.key("client"))})
    try:
        np.testing.assert_array_equal(identity(client, mod=httpclient), [1, 2, 3])
    finally:
        client.close()

    async def with_aiohttp() -> Any:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2],
                            "data": [4.0, 5.0]}]}
        async with aiohttp.ClientSession() as session, session.post(
                f"https://{mtls_proxy.http_url}/v2/models/identity_fp32/infer", json=body,
                ssl=client_ssl(pki)) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    answer = asyncio.run(with_aiohttp())
    assert answer["outputs"][0]["data"] == [4.0, 5.0]
    status, _ = https_get(f"https://{mtls_proxy.http_url}/v2/health/ready", client_ssl(pki))
    assert status == 200


def test_admin_listener_over_mutual_tls(mtls_proxy: RunningMmguard, pki: Pki) -> None:
    admin = mtls_proxy.admin_url.replace("http://", "https://")
    status, body = https_get(admin + "/metrics", client_ssl(pki))
    assert status == 200 and b"mmguard_requests_total" in body
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(admin + "/metrics", client_ssl(pki, client=None))


def test_client_without_a_certificate_is_refused(mtls_proxy: RunningMmguard, pki: Pki) -> None:
    client = grpc_client(mtls_proxy.grpc_url, pki, client=None)
    with pytest.raises(InferenceServerException) as exc:
        client.is_server_live(client_timeout=10)
    assert "UNAVAILABLE" in str(exc.value.status())
    client.close()
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(f"https://{mtls_proxy.http_url}/v2/health/ready", client_ssl(pki, client=None))


def test_client_trusting_another_ca_fails_the_handshake(mtls_proxy: RunningMmguard,
                                                        pki: Pki) -> None:
    client = grpc_client(mtls_proxy.grpc_url, pki, ca="other-ca")
    with pytest.raises(InferenceServerException) as exc:
        client.is_server_live(client_timeout=10)
    assert "UNAVAILABLE" in str(exc.value.status())
    assert "handshake" in exc.value.message().lower()
    client.close()
    with pytest.raises(urllib.error.URLError) as err:
        https_get(f"https://{mtls_proxy.http_url}/v2/health/ready",
                  client_ssl(pki, ca="other-ca"))
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)


def test_client_certificate_from_another_ca_is_refused(mtls_proxy: RunningMmguard,
                                                       pki: Pki) -> None:
    client = grpc_client(mtls_proxy.grpc_url, pki, client="other-client")
    with pytest.raises(InferenceServerException):
        client.is_server_live(client_timeout=10)
    client.close()
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_get(f"https://{mtls_proxy.http_url}/v2/health/ready",
                  client_ssl(pki, client="other-client"))


def test_plaintext_to_a_tls_port_fails(mtls_proxy: RunningMmguard) -> None:
    with grpc.insecure_channel(mtls_proxy.grpc_url) as channel:
        rpc = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        with pytest.raises(grpc.RpcError) as exc:
            rpc(b"", timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://{mtls_proxy.http_url}/v2/health/ready", timeout=10)


def test_tls_without_client_certificates_serves_anyone_who_trusts_it(pki: Pki,
                                                                     ort_models: Path) -> None:
    cfg = tls_config(ort_models, pki, mtls=False)
    cfg["listeners"]["http"]["tls"] = {**cfg["listeners"]["http"]["tls"], "min_version": "1.3"}
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        client = grpc_client(m.grpc_url, pki, client=None)
        np.testing.assert_array_equal(identity(client), [1, 2, 3])
        client.close()
        status, _ = https_get(f"https://{m.http_url}/v2/health/ready",
                              client_ssl(pki, client=None))
        assert status == 200
        old_client = client_ssl(pki, client=None)
        old_client.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(urllib.error.URLError) as exc:  # min_version 1.3 on this listener
            https_get(f"https://{m.http_url}/v2/health/ready", old_client)
        assert isinstance(exc.value.reason, ssl.SSLError)
        status, _ = https_get(m.admin_url.replace("http://", "https://") + "/healthz",
                              old_client)  # 1.2 is still fine on the admin listener
        assert status == 200


def test_rotated_certificates_are_served_after_sighup(pki: Pki, ort_models: Path,
                                                      tmp_path: Path) -> None:
    """cert-manager style: the files change in place, the config does not; after SIGHUP new
    connections on all three listeners see the new certificate, and a new client CA bundle
    decides which client certificates are accepted."""
    files = tmp_path / "tls"
    path = tmp_path / "mmguard.yaml"
    cfg = {**tls_config(ort_models, pki, files=files), "watch_config_s": 0}  # SIGHUP only
    path.write_text(yaml.safe_dump(cfg))
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        ports = p.ports
        url = f"127.0.0.1:{ports['grpc']}"
        client = grpc_client(url, pki)
        deadline = time.monotonic() + 30
        while not client.is_model_ready("identity_fp32") and time.monotonic() < deadline:
            time.sleep(0.1)
        np.testing.assert_array_equal(identity(client), [1, 2, 3])
        client.close()
        first = pki.serials["server"]
        assert peer_serial(ports["http"], pki) == first
        assert peer_serial(ports["admin"], pki) == first
        assert peer_serial(ports["grpc"], pki, grpc_port=True) == first

        shutil.copy(pki.cert("server2"), files / "listener.pem")
        shutil.copy(pki.key("server2"), files / "listener.key")
        p.signal(signal.SIGHUP)
        p.wait_log("config reloaded from")
        second = pki.serials["server2"]
        assert peer_serial(ports["http"], pki) == second
        assert peer_serial(ports["admin"], pki) == second
        assert peer_serial(ports["grpc"], pki, grpc_port=True) == second
        client = grpc_client(url, pki)
        np.testing.assert_array_equal(identity(client), [1, 2, 3])
        client.close()
        assert "TLS certificates reloaded" in p.log_path.read_text()

        # A new client CA bundle: clients of the old CA are out, the other CA's are in.
        shutil.copy(pki.cert("other-ca"), files / "clients-ca.pem")
        p.signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while p.log_path.read_text().count("config reloaded from") < 2:
            assert time.monotonic() < deadline, p.log_path.read_text()[-3000:]
            time.sleep(0.1)
        assert peer_serial(ports["http"], pki, client="other-client") == second
        with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
            peer_serial(ports["http"], pki, client="client")
        client = grpc_client(url, pki, client="other-client")
        np.testing.assert_array_equal(identity(client), [1, 2, 3])
        client.close()
        client = grpc_client(url, pki, client="client")
        with pytest.raises(InferenceServerException):
            client.is_server_live(client_timeout=10)
        client.close()
    finally:
        assert p.stop() == 0


# --- config ---------------------------------------------------------------------------------


def _problem(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg)
    return str(exc.value)


def test_unreadable_or_bad_tls_files_are_config_errors_naming_the_file(
        pki: Pki, ort_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.pem"
    cfg = tls_config(ort_models, pki)
    cfg["listeners"]["http"]["tls"] = {**tls_block(pki), "cert_file": str(missing)}
    text = _problem(cfg)
    assert f"listeners.http.tls.cert_file: Value error, cannot read {missing}" in text

    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    cfg = tls_config(ort_models, pki)
    cfg["listeners"]["grpc"]["tls"] = {**tls_block(pki), "key_file": str(garbage)}
    assert f"listeners.grpc.tls.key_file: Value error, {garbage} is not a PEM private key" \
        in _problem(cfg)

    cfg = tls_config(ort_models, pki)  # a key that is not the certificate's
    cfg["listeners"]["admin"]["tls"] = {**tls_block(pki), "key_file": str(pki.key("client"))}
    text = _problem(cfg)
    assert "listeners.admin.tls: Value error, the TLS files do not load together" in text
    assert str(pki.key("client")) in text

    broken = tmp_path / "broken.pem"  # PEM markers around garbage
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cfg = ort_config(ort_models)
    cfg["backends"] = [{"kind": "triton_http", "name": "t", "url": "h:1",
                        "tls": {"ca_file": str(broken)}}]
    cfg["models"] = []
    text = _problem(cfg)
    assert "backends[0].tls: Value error, the TLS files do not load together" in text
    assert str(broken) in text

    cfg = tls_config(ort_models, pki)
    cfg["listeners"]["http"]["tls"] = {**tls_block(pki), "cert_file": str(missing)}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["check-config", str(path)]) == 1
    assert f"cannot read {missing}" in capsys.readouterr().err


def test_tls_options_that_cannot_work_are_refused(pki: Pki, ort_models: Path) -> None:
    cfg = tls_config(ort_models, pki)
    cfg["listeners"]["grpc"]["tls"] = {**tls_block(pki), "min_version": "1.3"}
    assert "listeners.grpc: Value error, tls.min_version" in _problem(cfg)
    cfg = ort_config(ort_models)
    cfg["backends"] = [{"kind": "triton_grpc", "name": "g", "url": "h:1",
                        "tls": {"insecure_skip_verify": True}}]
    cfg["models"] = []
    assert "backends[0]: Value error, tls.insecure_skip_verify is not available" \
        in _problem(cfg)
    cfg["backends"] = [{"kind": "vllm", "name": "v", "url": "http://h:1", "tls": {}}]
    assert "backends[0]: Value error, url 'http://h:1' is plain http:// but tls is set" \
        in _problem(cfg)
    cfg["backends"] = [{"kind": "triton_http", "name": "t", "url": "h:1",
                        "tls": {"cert_file": str(pki.cert("client"))}}]
    assert "cert_file and key_file go together" in _problem(cfg)


# --- backends -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_backend(pki: Pki, ort_models: Path) -> Iterator[RunningMmguard]:
    """A real TLS peer for the backends: mmguard with mutual TLS on its fronts, serving
    identity_fp32 from ONNX Runtime over the real v2 protocols."""
    cfg = tls_config(ort_models, pki)
    cfg["listeners"]["admin"] = {}
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def _client_tls(pki: Pki, ca: str = "ca", **extra: Any) -> dict[str, Any]:
    return {"ca_file": str(pki.cert(ca)), "cert_file": str(pki.cert("client")),
            "key_file": str(pki.key("client")), **extra}


def _outer(backends: list[dict[str, Any]]) -> dict[str, Any]:
    return {"backends": backends,
            "models": [{"name": b["name"], "backend": b["name"],
                        "backend_model": "identity_fp32"} for b in backends]}


def _infer_outer(outer: RunningMmguard, model: str, timeout: float = 30) -> NDArray[Any]:
    """Through the outer proxy's plain gRPC front; waits while the backend still connects."""
    client = grpcclient.InferenceServerClient(outer.grpc_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return identity(client, model)
            except InferenceServerException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        client.close()


def _refusal(outer: RunningMmguard, model: str) -> InferenceServerException:
    client = grpcclient.InferenceServerClient(outer.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as exc:
            identity(client, model)
        return exc.value
    finally:
        client.close()


def test_backends_over_mutual_tls(tls_backend: RunningMmguard, pki: Pki,
                                  caplog: pytest.LogCaptureFixture) -> None:
    cfg = _outer([
        {"kind": "triton_grpc", "name": "grpc-mtls", "url": tls_backend.grpc_url,
         "tls": _client_tls(pki)},
        {"kind": "triton_http", "name": "http-mtls", "url": tls_backend.http_url,
         "tls": _client_tls(pki)},
        {"kind": "triton_grpc", "name": "grpc-named", "url": tls_backend.grpc_url,
         "tls": _client_tls(pki, server_name="localhost")},
        {"kind": "triton_http", "name": "http-named", "url": f"https://{tls_backend.http_url}",
         "tls": _client_tls(pki, server_name="localhost")},
        {"kind": "triton_http", "name": "http-unverified", "url": tls_backend.http_url,
         "tls": {"cert_file": str(pki.cert("client")), "key_file": str(pki.key("client")),
                 "insecure_skip_verify": True}},
    ])
    with RunningMmguard(cfg) as outer:
        outer.wait_ready()
        for name in ("grpc-mtls", "http-mtls", "grpc-named", "http-named", "http-unverified"):
            np.testing.assert_array_equal(_infer_outer(outer, name), [1, 2, 3])
    assert "backend 'http-unverified': TLS certificate verification is off" in caplog.text


def test_backend_tls_failures_are_unavailable_and_name_the_backend(
        tls_backend: RunningMmguard, pki: Pki) -> None:
    cfg = _outer([
        {"kind": "triton_grpc", "name": "grpc-wrong-ca", "url": tls_backend.grpc_url,
         "tls": _client_tls(pki, ca="other-ca")},
        {"kind": "triton_http", "name": "http-wrong-ca", "url": tls_backend.http_url,
         "tls": _client_tls(pki, ca="other-ca")},
        {"kind": "triton_grpc", "name": "grpc-wrong-name", "url": tls_backend.grpc_url,
         "tls": _client_tls(pki, server_name="elsewhere.example")},
        {"kind": "triton_http", "name": "http-wrong-name", "url": tls_backend.http_url,
         "tls": _client_tls(pki, server_name="elsewhere.example")},
        # https:// without a tls block: TLS with the system's trust store, which lacks our CA
        {"kind": "triton_http", "name": "http-system-trust",
         "url": f"https://{tls_backend.http_url}"},
        {"kind": "triton_grpc", "name": "grpc-no-client-cert", "url": tls_backend.grpc_url,
         "tls": {"ca_file": str(pki.cert("ca"))}},
    ])
    with RunningMmguard(cfg) as outer:
        for name in ("grpc-wrong-ca", "http-wrong-ca", "grpc-wrong-name", "http-wrong-name",
                     "http-system-trust", "grpc-no-client-cert"):
            err = _refusal(outer, name)
            assert "UNAVAILABLE" in str(err.status()), (name, err)
            assert f"backend '{name}'" in err.message(), err.message()
        assert "CERTIFICATE_VERIFY_FAILED" in _refusal(outer, "grpc-wrong-ca").message()
        assert "certificate verify failed" in _refusal(outer, "http-wrong-ca").message()
        assert "certificate verify failed" in _refusal(outer, "http-system-trust").message()


def test_backend_rebuilt_when_its_certificate_files_change_under_the_same_config(
        tls_backend: RunningMmguard, pki: Pki, tmp_path: Path) -> None:
    ca = tmp_path / "backend-ca.pem"
    shutil.copy(pki.cert("other-ca"), ca)  # wrong at first
    cfg = _outer([{"kind": "triton_grpc", "name": "grpc-rotating", "url": tls_backend.grpc_url,
                   "tls": {**_client_tls(pki), "ca_file": str(ca)}},
                  {"kind": "triton_http", "name": "http-rotating", "url": tls_backend.http_url,
                   "tls": {**_client_tls(pki), "ca_file": str(ca)}}])
    path = tmp_path / "outer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with RunningMmguard(cfg, config_path=path) as outer:
        assert outer.server is not None
        for name in ("grpc-rotating", "http-rotating"):
            assert "UNAVAILABLE" in str(_refusal(outer, name).status())
        before = dict(outer.server.plane.runtime.backends)
        assert outer.run(outer.server.reload())  # nothing changed: the backends are kept
        assert outer.server.plane.runtime.backends == before
        shutil.copy(pki.cert("ca"), ca)  # the same path, the right CA
        assert outer.run(outer.server.reload())
        after = outer.server.plane.runtime.backends
        assert all(after[n] is not before[n] for n in before)
        for name in ("grpc-rotating", "http-rotating"):
            np.testing.assert_array_equal(_infer_outer(outer, name), [1, 2, 3])


def test_a_stop_right_after_a_reload_closes_every_backend_connection_tls_included(
        tls_backend: RunningMmguard, pki: Pki, tmp_path: Path) -> None:
    """A stop within the grace of a reload also closes the backends of the runtime that reload
    retired (they waited out their grace on a task the stop never ran), and a TLS backend's
    connections are gone when ``stop`` returns: their goodbye (close_notify) is waited for, not
    left to a loop that is about to end with their sockets open."""
    def config(timeout_s: float) -> dict[str, Any]:
        cfg = _outer([{"kind": "triton_http", "name": "http-tls", "url": tls_backend.http_url,
                       "tls": _client_tls(pki), "timeout_s": timeout_s}])
        return {**cfg, "shutdown_grace_s": 60}

    path = tmp_path / "outer.yaml"
    path.write_text(yaml.safe_dump(config(30)))
    with RunningMmguard(config(30), config_path=path) as outer:
        assert outer.server is not None
        np.testing.assert_array_equal(_infer_outer(outer, "http-tls"), [1, 2, 3])
        old = outer.server.plane.runtime.backends["http-tls"]
        path.write_text(yaml.safe_dump(config(20)))  # a changed backend: built anew
        assert outer.run(outer.server.reload())
        new = outer.server.plane.runtime.backends["http-tls"]
        assert new is not old
        np.testing.assert_array_equal(_infer_outer(outer, "http-tls"), [1, 2, 3])
        pools = [b.pool for b in (old, new)]  # type: ignore[attr-defined]
        conns = [c for pool in pools for c in pool._idle]
        assert len(conns) == 2, "each runtime's backend holds its keep-alive connection"
        started = time.monotonic()
        outer.stop()
        assert time.monotonic() - started < 30, "the stop waited out the retired runtime's grace"
    assert all(c.lost for c in conns), "a backend connection outlived the stop"
    assert all(pool.closed and not pool._idle for pool in pools)
    assert old._session is None and new._session is None  # type: ignore[attr-defined]


def test_listener_settings_that_need_a_restart_are_named_at_reload(
        pki: Pki, ort_models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tls_config(ort_models, pki)
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with RunningMmguard(parse_config(cfg), config_path=path) as m:
        assert m.server is not None
        m.wait_ready()
        cfg["listeners"]["http"] = {"tls": tls_block(pki, mtls=False)}
        cfg["listeners"]["grpc"] = {"tls": tls_block(pki), "max_header_bytes": 4096}
        path.write_text(yaml.safe_dump(cfg))
        assert m.run(m.server.reload())
        text = caplog.text
        assert ("listeners.http: a change to tls (turning client certificates (mutual TLS) on or "
                "off) needs a restart") in text
        assert "listeners.grpc: a change to max_header_bytes needs a restart" in text
        # Still mutual TLS on HTTP: what runs is what started.
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            https_get(f"https://{m.http_url}/v2/health/ready", client_ssl(pki, client=None))
        status, _ = https_get(f"https://{m.http_url}/v2/health/ready", client_ssl(pki))
        assert status == 200


def _resumed_get(port: int, ctx: ssl.SSLContext,
                 session: ssl.SSLSession | None) -> tuple[bool, str, ssl.SSLSession | None]:
    """One HTTPS GET on a new connection offering ``session``: (resumed?, the status line or
    the error, the session to offer next time)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as conn:
            conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
            return bool(conn.session_reused), answer.split(b"\r\n", 1)[0].decode(), conn.session
    except (ssl.SSLError, OSError) as exc:
        return False, f"{type(exc).__name__}: {exc}", None


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_a_rotated_client_ca_ends_resumption_of_sessions_made_under_the_old_one(
        pki: Pki, ort_models: Path, tmp_path: Path, version: str) -> None:
    """Issue 26 item 4: after ``client_ca_file`` rotates from CA1 to another CA, a CA1 client
    that offers its earlier TLS session (Python's ``session=``, a ticket in 1.3 or a session id
    in 1.2) must not be served: the new context has its own session cache and ticket keys, so
    the client falls back to a full handshake, which the new CA refuses. Before the rotation the
    same client does resume (so the test can tell resumption from a full handshake)."""
    files = tmp_path / "tls"
    path = tmp_path / "mmguard.yaml"
    cfg = {**tls_config(ort_models, pki, files=files), "watch_config_s": 0}
    path.write_text(yaml.safe_dump(cfg))
    ctx = client_ssl(pki)
    ctx.maximum_version = ctx.minimum_version = (ssl.TLSVersion.TLSv1_2 if version == "1.2"
                                                 else ssl.TLSVersion.TLSv1_3)
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        port = p.ports["http"]
        reused, status, session = _resumed_get(port, ctx, None)
        assert (reused, status) == (False, "HTTP/1.1 200 OK") and session is not None
        reused, status, again = _resumed_get(port, ctx, session)
        assert (reused, status) == (True, "HTTP/1.1 200 OK"), "the client did not resume"
        session = again or session

        shutil.copy(pki.cert("other-ca"), files / "clients-ca.pem")
        p.signal(signal.SIGHUP)
        p.wait_log("TLS certificates reloaded")
        reused, status, _ = _resumed_get(port, ctx, session)
        assert not reused and status != "HTTP/1.1 200 OK", (reused, status)
        # a fresh handshake of the new CA's client is served, and resumes under the new context
        other = client_ssl(pki, client="other-client")
        other.maximum_version = other.minimum_version = ctx.minimum_version
        reused, status, fresh = _resumed_get(port, other, None)
        assert (reused, status) == (False, "HTTP/1.1 200 OK")
        assert _resumed_get(port, other, fresh)[:2] == (True, "HTTP/1.1 200 OK")
    finally:
        assert p.stop() == 0


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _resumed_h2(port: int, ctx: ssl.SSLContext,
                session: ssl.SSLSession | None) -> tuple[bool, int, ssl.SSLSession | None]:
    """A TLS connection to the gRPC port offering ``session``, the HTTP/2 preface sent: (resumed?,
    bytes of the server's answer (its SETTINGS; 0: it closed), the session)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as conn:
            conn.sendall(_H2_PREFACE)
            return bool(conn.session_reused), len(conn.recv(100)), conn.session
    except (ssl.SSLError, OSError):
        return False, 0, None


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_a_rotated_client_ca_ends_resumption_on_the_grpc_listener_too(
        pki: Pki, ort_models: Path, tmp_path: Path, version: str) -> None:
    """The gRPC listener's dynamic credentials build a new SSL context on rotation (gRPC core):
    the old sessions are not resumed there either."""
    files = tmp_path / "tls"
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump({**tls_config(ort_models, pki, files=files),
                                    "watch_config_s": 0}))
    ctx = client_ssl(pki, alpn=["h2"])
    ctx.maximum_version = ctx.minimum_version = (ssl.TLSVersion.TLSv1_2 if version == "1.2"
                                                 else ssl.TLSVersion.TLSv1_3)
    p = MmguardProcess(["--config", str(path)], tmp_path / "serve.log")
    try:
        port = p.ports["grpc"]
        reused, answered, session = _resumed_h2(port, ctx, None)
        assert not reused and answered > 0 and session is not None
        reused, answered, again = _resumed_h2(port, ctx, session)
        assert reused and answered > 0, "the client did not resume"
        shutil.copy(pki.cert("other-ca"), files / "clients-ca.pem")
        p.signal(signal.SIGHUP)
        p.wait_log("TLS certificates reloaded")
        reused, answered, _ = _resumed_h2(port, ctx, again or session)
        assert not reused and answered == 0, (reused, answered)
    finally:
        assert p.stop() == 0
