"""ONNX Runtime in-process: one session per model from a model directory, run in a bounded pool.

The CUDA provider is used when the ``gpu`` extra (onnxruntime-gpu) is installed and CUDA really
loads; the providers that actually loaded are logged, because ONNX Runtime falls back to the CPU
without a word when a CUDA library is missing.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import onnxruntime as ort
except ImportError as exc:  # `pip install mmguard` without an ONNX Runtime extra
    raise ImportError("ONNX Runtime is not installed: install mmguard with the 'cpu' extra "
                      "(pip install 'mmguard[cpu]') or, for CUDA, the 'gpu' extra (never both)",
                      name="onnxruntime") from exc

from proxy.backends.base import Backend
from proxy.backends.classification import class_count, classify
from proxy.call import BACKEND_TIMED_S, Call, Result, Target
from proxy.config.backends import OnnxRuntimeBackendConfig
from proxy.config.refs import find_models
from proxy.contract import ModelContract, TensorSpec
from proxy.errors import ErrorKind, ProxyError, name_list, unknown_model
from proxy.tensor import Tensor
from proxy.wire.answers import answer_source, check_outputs

log = logging.getLogger("mmguard.backend.onnxruntime")

_ORT_TYPES = {
    "tensor(float)": "FP32", "tensor(float16)": "FP16", "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16", "tensor(int8)": "INT8", "tensor(int16)": "INT16",
    "tensor(int32)": "INT32", "tensor(int64)": "INT64", "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL", "tensor(string)": "BYTES",
}
_BF16 = 16  # ONNX TensorProto.BFLOAT16


@dataclass
class _Model:
    session: ort.InferenceSession
    contract: ModelContract
    output_types: dict[str, str]


class OnnxRuntimeBackend(Backend):
    protocol = "inprocess"

    def __init__(self, cfg: OnnxRuntimeBackendConfig) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self.timeout_s = cfg.timeout_s
        self._pool = ThreadPoolExecutor(max_workers=cfg.threads,
                                        thread_name_prefix=f"ort-{cfg.name}")
        self._models: dict[str, _Model] = {}
        self.providers: list[str] = []
        self._closed = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._load_all)

    def _load_all(self) -> None:
        found = find_models(self.cfg.model_dir)
        wanted = self.cfg.models if self.cfg.models is not None else tuple(found)
        missing = [m for m in wanted if m not in found]
        if missing:
            raise ProxyError(ErrorKind.UNAVAILABLE,
                             f"backend '{self.name}': no model file for {missing} under "
                             f"{self.cfg.model_dir}")
        for name in wanted:
            version, path = found[name]
            self._models[name] = self._load(name, version, path)

    def _providers(self) -> list[str]:
        available = ort.get_available_providers()
        if self.cfg.device != "cpu" and "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if self.cfg.device == "cuda":
            raise ProxyError(ErrorKind.UNAVAILABLE,
                             f"backend '{self.name}': device 'cuda' asked for, but onnxruntime "
                             f"offers only {available} (install the 'gpu' extra)")
        return ["CPUExecutionProvider"]

    def _load(self, name: str, version: str, path: Path) -> _Model:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.cfg.intra_op_threads
        opts.inter_op_num_threads = 1
        data = path.read_bytes()
        session = ort.InferenceSession(data, sess_options=opts, providers=self._providers())
        loaded = session.get_providers()
        if self.cfg.device == "cuda" and "CUDAExecutionProvider" not in loaded:
            raise ProxyError(ErrorKind.UNAVAILABLE,
                             f"backend '{self.name}': CUDA did not load for model '{name}' "
                             f"(loaded: {loaded})")
        self.providers = loaded
        mbs = self.cfg.max_batch_size.get(name, 0)
        inputs = tuple(TensorSpec(i.name, _datatype(i.type), _dims(i.shape))
                       for i in session.get_inputs())
        outputs = tuple(TensorSpec(o.name, _datatype(o.type), _dims(o.shape))
                        for o in session.get_outputs())
        contract = ModelContract(
            name=name, versions=(version,), platform="onnxruntime_onnx", inputs=inputs,
            outputs=outputs, max_batch_size=mbs,
            fingerprint=hashlib.sha256(data).hexdigest(),
        )
        log.info("loaded model %r version %s from %s with providers %s", name, version, path,
                 loaded, extra={"fields": {"model": name, "providers": loaded}})
        return _Model(session, contract, {o.name: o.datatype for o in outputs})

    async def ready(self) -> bool:
        return bool(self._models)

    async def model_ready(self, model: str, version: str = "") -> bool:
        m = self._models.get(model)
        return m is not None and (not version or version in m.contract.versions)

    async def metadata(self, model: str, version: str = "") -> ModelContract:
        return self._model(model).contract

    def _model(self, model: str) -> _Model:
        if self._closed:
            raise ProxyError(ErrorKind.UNAVAILABLE, f"backend '{self.name}' was closed before "
                             f"model '{model}' ran: a config reload replaced it, or mmguard "
                             "is stopping")
        m = self._models.get(model)
        if m is None:
            raise ProxyError(ErrorKind.NOT_FOUND,
                             f"backend '{self.name}' has no model '{model}' "
                             f"(loaded: {sorted(self._models)})")
        return m

    async def infer(self, call: Call, target: Target) -> Result:
        m = self._model(target.model)
        if target.version and target.version not in m.contract.versions:
            # in process, mmguard is the backend: Triton's words, with the client's name
            raise unknown_model(call.model, target.version)
        expected = {t.name: t for t in m.contract.inputs}
        given = [t.name for t in call.inputs]
        unknown_in = [n for n in given if n not in expected]
        missing = [n for n, spec in expected.items()
                   if n not in given and not spec.optional]
        if unknown_in or missing:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"model '{target.model}' expects inputs {name_list(expected)}; "
                             + (f"unknown: {name_list(unknown_in)}" if unknown_in else "")
                             + ("; " if unknown_in and missing else "")
                             + (f"missing: {name_list(missing)}" if missing else ""))
        feeds = {t.name: _feed(t) for t in call.inputs}
        names = [o.name for o in call.outputs] or list(m.output_types)
        unknown = [n for n in names if n not in m.output_types]
        if unknown:
            raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                             f"model '{target.model}' has no output {name_list(unknown)}; "
                             f"outputs are {name_list(m.output_types)}")
        asked = {o.name: class_count(o.name, o.parameters) for o in call.outputs}
        classes = [asked.get(n, 0) for n in names]
        timeout = self.timeout_for(call)
        loop = asyncio.get_running_loop()
        handed = time.monotonic()
        fut = loop.run_in_executor(self._pool, _timed_run, m.session, names, feeds)
        try:
            arrays, ended = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise self.deadline_error(target, timeout) from None
        call.state[BACKEND_TIMED_S] = ended - handed  # the pool's queue and the run, not the loop
        outputs = [_to_tensor(n, a, m.output_types[n]) for n, a in zip(names, arrays, strict=True)]
        check_outputs(outputs, answer_source(self.name, target.model))
        for i, k in enumerate(classes):
            if k:  # Triton's classification extension, computed here as Triton would
                outputs[i] = classify(outputs[i], k, m.contract.max_batch_size > 0,
                                      target.model)
        return Result(target.model, m.contract.versions[0], call.id, outputs)

    async def close(self, drain: bool = False) -> None:
        """``drain``: the calls already handed to the threads run and are answered; one that
        comes later is refused, naming the reload."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=not drain)
        self._models.clear()


def _timed_run(session: ort.InferenceSession, names: list[str],
               feeds: dict[str, Any]) -> tuple[list[Any], float]:
    """``_run``, and when it ended, read in the worker thread."""
    arrays = _run(session, names, feeds)
    return arrays, time.monotonic()


def _run(session: ort.InferenceSession, names: list[str], feeds: dict[str, Any]) -> list[Any]:
    try:
        if any(isinstance(v, ort.OrtValue) for v in feeds.values()):
            values = session.run_with_ort_values(names, {
                k: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v)
                for k, v in feeds.items()})
            return list(values)
        return list(session.run(names, feeds))
    except Exception as exc:  # onnxruntime raises its own classes for every input error
        text = str(exc)
        kind = ErrorKind.INVALID_ARGUMENT if "INVALID_ARGUMENT" in text or \
            "InvalidArgument" in type(exc).__name__ else ErrorKind.INTERNAL
        raise ProxyError(kind, text.removeprefix("[ONNXRuntimeError] : "),
                         origin="backend") from None


def _feed(t: Tensor) -> Any:
    if t.datatype == "BF16":
        bits = np.frombuffer(t.raw_bytes(), dtype=np.uint16).reshape(t.shape)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, _BF16)
    arr = t.numpy()
    if t.datatype == "BYTES":
        flat = arr.reshape(-1)
        text = np.empty(flat.shape, dtype=object)
        for i, item in enumerate(flat):
            try:
                text[i] = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProxyError(ErrorKind.INVALID_ARGUMENT,
                                 f"input '{t.name}': element {i} is not UTF-8 ({exc.reason} at "
                                 f"byte {exc.start}); ONNX Runtime string tensors hold UTF-8 text"
                                 ) from None
        return text.reshape(arr.shape)
    return arr


def _to_tensor(name: str, value: Any, datatype: str) -> Tensor:
    if isinstance(value, ort.OrtValue):
        if datatype == "BF16":
            shape = tuple(value.shape())
            raw = _ortvalue_bytes(value)
            return Tensor(name, "BF16", shape, raw=raw)
        value = value.numpy()
    return Tensor.from_numpy(name, value, datatype)


def _ortvalue_bytes(value: ort.OrtValue) -> bytes:
    # A BF16 OrtValue has no numpy form; copy its bytes out of host memory directly.
    if value.device_name().lower() != "cpu":
        raise ProxyError(ErrorKind.UNIMPLEMENTED, "BF16 outputs are read from CPU memory only")
    return ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())


def _datatype(ort_type: str) -> str:
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise ProxyError(ErrorKind.UNAVAILABLE, f"unsupported ONNX type {ort_type}") from None


def _dims(shape: list[Any]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)
