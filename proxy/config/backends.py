"""The backends' config models (``backends:`` in the config file), one per ``kind``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from proxy.config.tls import TlsClient
from proxy.strict import Strict

MiB = 1024 * 1024


class SharedMemoryHandoffConfig(Strict):
    """Slots mmguard registers with a co-located Triton (``shared_memory: system``)."""

    slots: int = Field(16, ge=1, le=1024)
    """Calls that can be in a slot at once; a call that finds none free goes inline."""
    max_slot_bytes: int = Field(64 * MiB, gt=0)
    """A slot is sized from the live contracts (largest fixed-size request + answer), up to
    this; a call that does not fit goes inline."""


def _check_colocated(url: str, shared_memory: str) -> None:
    if shared_memory == "off":
        return
    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host not in ("localhost", "127.0.0.1", "::1"):
        raise ValueError(f"shared_memory: {shared_memory} needs Triton beside mmguard (a "
                         f"loopback url, sharing /dev/shm), not {url!r}")


class TritonBackendCommon(Strict):
    """What both Triton backends take beside their transport."""

    shared_memory: Literal["off", "system"] = "off"
    """``system``: input tensors (and outputs of known size) cross to Triton in mmguard's own
    /dev/shm regions instead of the request (docs/shared-memory.md)."""
    shared_memory_pool: SharedMemoryHandoffConfig = SharedMemoryHandoffConfig()
    fingerprint_files: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    """Model (as Triton names it) → files whose SHA-256 joins its fingerprint (tokenizer.json,
    preprocessor_config.json, ...): the version fuse then sees a tokenizer or processor change
    that the model config does not show."""


class TritonGrpcBackendConfig(TritonBackendCommon):
    kind: Literal["triton_grpc"]
    name: str
    url: str
    """host:port of Triton's gRPC endpoint."""
    timeout_s: float = Field(30.0, gt=0)
    """Until the answer, or until a stream's first response (then ``stream_idle_timeout_s``)."""
    stream_idle_timeout_s: float = Field(300.0, gt=0)
    """A stream (``ModelStreamInfer``, a decoupled model) that sends nothing for this long
    after its first response is broken off with an error naming this setting; one that keeps
    talking runs as long as it talks (the client's deadline, when it sets one, still bounds
    it). As vLLM's, and Envoy's ``stream_idle_timeout``."""
    channels: int = Field(1, ge=1, le=64)
    """gRPC channels (HTTP/2 connections) used round-robin."""
    max_message_bytes: int = Field(256 * MiB, gt=0)
    tls: TlsClient | None = None
    """TLS to Triton (mutual with ``cert_file``/``key_file``); plaintext when absent."""

    @model_validator(mode="after")
    def _verify(self) -> TritonGrpcBackendConfig:
        _check_colocated(self.url, self.shared_memory)
        if self.tls is not None and self.tls.insecure_skip_verify:
            raise ValueError("tls.insecure_skip_verify is not available for triton_grpc "
                             "(grpcio always verifies); give tls.ca_file instead")
        return self


class TritonHttpBackendConfig(TritonBackendCommon):
    kind: Literal["triton_http"]
    name: str
    url: str
    """http://host:port (or host:port) of Triton's HTTP endpoint."""
    timeout_s: float = Field(30.0, gt=0)
    pool_size: int = Field(64, ge=1)
    """Keep-alive connections kept open to the server."""
    max_message_bytes: int = Field(256 * MiB, gt=0)
    """The largest answer taken from the server (for a stream: one event), as a
    ``triton_grpc`` backend's: past it (declared, or as it arrives) the call is a bad gateway
    (502) naming this setting and the connection is closed, so a broken server cannot make
    mmguard hold an answer without end."""
    tls: TlsClient | None = None
    """TLS to Triton; an ``https://`` url without it uses the system's trust store."""
    infer_client: Literal["httptools", "aiohttp"] = "httptools"
    """The client of infer calls: ``httptools``, a lean keep-alive HTTP/1.1 client (12–27 %
    less of mmguard's CPU per call, bench/README.md), or ``aiohttp``, the session that
    every other call to this server (health, metadata, repository) uses."""

    @model_validator(mode="after")
    def _scheme(self) -> TritonHttpBackendConfig:
        _check_scheme(self.url, self.tls)
        _check_colocated(self.url, self.shared_memory)
        return self


class OnnxRuntimeBackendConfig(Strict):
    kind: Literal["onnxruntime"]
    name: str
    model_dir: Path
    """A repository laid out like Triton's: <model>/<version>/model.onnx (or <model>.onnx)."""
    models: tuple[str, ...] | None = None
    """Models to load; all found in model_dir when absent."""
    threads: int = Field(2, ge=1, le=256)
    """Worker threads running inference (the bounded pool)."""
    intra_op_threads: int = Field(1, ge=0)
    """ONNX Runtime's own threads per run; 0 lets it decide."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when onnxruntime-gpu is installed and CUDA really loads, else CPU."""
    max_batch_size: dict[str, int] = Field(default_factory=dict)
    """Per model: declare the leading dim a batch dim of at most this size (Triton's meaning)."""
    timeout_s: float = Field(30.0, gt=0)


class VllmBackendConfig(Strict):
    kind: Literal["vllm"]
    name: str
    url: str
    """http://host:port of vLLM's OpenAI-compatible server."""
    timeout_s: float = Field(60.0, gt=0)
    """Until the answer starts (for streams) or ends (otherwise)."""
    stream_idle_timeout_s: float = Field(300.0, gt=0)
    """A stream that sends nothing for this long (a hung server) is broken off: the client
    gets a 504 (before the first event) or an error event naming this setting, and the
    connection is closed. Generous by default, as Envoy's ``stream_idle_timeout``: a queued
    or long prompt can take a while to its first token."""
    pool_size: int = Field(100, ge=1)
    max_message_bytes: int = Field(256 * MiB, gt=0)
    """The largest answer taken from the server (for a stream: one event), as a
    ``triton_grpc`` backend's: past it (declared, or as it arrives) the call is a bad gateway
    (502) naming this setting and the connection is closed, so a broken server cannot make
    mmguard hold an answer without end."""
    image_input: Literal["auto", "yes", "no"] = "auto"
    """Whether the model takes images; auto probes once with a one-token request."""
    tls: TlsClient | None = None
    """TLS to vLLM; an ``https://`` url without it uses the system's trust store."""
    infer_client: Literal["httptools", "aiohttp"] = "httptools"
    """The client of chat, completion and responses calls, streamed or not: ``httptools``, a
    lean keep-alive HTTP/1.1 client, or ``aiohttp``, the session every other call to this
    server (health, models, tokenize) uses."""

    @model_validator(mode="after")
    def _scheme(self) -> VllmBackendConfig:
        _check_scheme(self.url, self.tls)
        return self


def _check_scheme(url: str, tls: TlsClient | None) -> None:
    if tls is not None and url.lower().startswith("http://"):
        raise ValueError(f"url '{url}' is plain http:// but tls is set; write https:// "
                         f"(or host:port)")


BackendConfig = Annotated[
    TritonGrpcBackendConfig | TritonHttpBackendConfig | OnnxRuntimeBackendConfig
    | VllmBackendConfig, Field(discriminator="kind")]
