"""What ``python -m bench.proxy`` measures: the tensors, the models and routes that serve them,
and the names both sides of a cell agree on."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class TensorCase:
    key: str
    label: str
    shape: tuple[int, ...]
    triton_model: str  # Triton's name; also mmguard's route to the triton_grpc backend
    triton_in: str
    triton_out: str
    op: str  # "identity" or "double": what the Triton model computes (checked on the answer)
    ort_model: str  # mmguard's route (and file) on the onnxruntime backend

    @property
    def http_route(self) -> str:  # mmguard's route to the triton_http backend
        return self.triton_model + "_h"


CASES = (
    TensorCase("pixel", "FP32 [1,3,224,224]", (1, 3, 224, 224), "pixel_identity",
               "pixel_values", "pixel_out", "identity", "identity_pixel"),
    TensorCase("small", "FP32 [1,16]", (1, 16), "small_fp32", "x", "y", "double",
               "identity_small"),
)
ORT_IN, ORT_OUT = "INPUT0", "OUTPUT0"
PROTOCOLS = ("grpc", "http")
