"""shape_guard over real backends: every check and every policy, each shown to matter (the same
request without the guard is silently cut, padded or refused by the backend instead)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from proxy.cli.demo_model import ensure_clip_demo
from proxy.pb import grpc_service_pb2 as pb
from tests.conftest import ort_config, triton_routes
from tests.support.fake_v2 import FakeV2
from tests.support.mmguard import RunningMmguard
from tests.support.triton import TritonServer, write_model_repository
from tests.support.wire import grpc_infer_raw, grpc_request, http_binary_body, http_post


def f32(*shape: int, seed: int = 0) -> NDArray[np.float32]:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def t(name: str, arr: NDArray[Any], dt: str | None = None) -> tuple[str, str, list[int], bytes]:
    dt = dt or {"float32": "FP32", "float64": "FP64", "int64": "INT64"}[str(arr.dtype)]
    return name, dt, list(arr.shape), np.ascontiguousarray(arr).tobytes()


def refused(url: str, model: str, tensors: list[Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        grpc_infer_raw(url, grpc_request(model, tensors))
    return exc.value


def answer(url: str, model: str,
           tensors: list[Any]) -> tuple[pb.ModelInferResponse, dict[str, str]]:
    body, trailers = grpc_infer_raw(url, grpc_request(model, tensors))
    return pb.ModelInferResponse.FromString(body), dict(trailers or ())


def output(resp: pb.ModelInferResponse, name: str, dtype: str = "<f4") -> NDArray[Any]:
    i = [o.name for o in resp.outputs].index(name)
    return np.frombuffer(resp.raw_output_contents[i], dtype).reshape(list(resp.outputs[i].shape))


# --- ONNX Runtime (symbolic dims) -----------------------------------------------------------

TEXT = {"input_ids": {"max_tokens": 77, "pad_token_id": 0}}


@pytest.fixture(scope="module")
def ort(ort_models: Path) -> Iterator[RunningMmguard]:
    cfg = ort_config(ort_models)
    cfg["models"] = [
        {"name": "clip_demo", "backend": "ort"},
        {"name": "clip_guarded", "backend": "ort", "backend_model": "clip_demo",
         "filters": [{"shape_guard": {}}]},
        {"name": "text_encoder", "backend": "ort"},
        {"name": "text_guarded", "backend": "ort", "backend_model": "text_encoder",
         "filters": [{"shape_guard": {"inputs": TEXT}}]},
        {"name": "text_truncate", "backend": "ort", "backend_model": "text_encoder",
         "filters": [{"shape_guard": {"inputs": TEXT, "on_tokens": "truncate"}}]},
        {"name": "text_reroute", "backend": "ort", "backend_model": "text_encoder",
         "filters": [{"shape_guard": {"inputs": TEXT, "on_tokens": "reroute",
                                      "reroute_to": "text_long"}}]},
        {"name": "text_long", "backend": "ort", "backend_model": "text_encoder",
         "filters": [{"shape_guard": {"inputs": {"input_ids": {"max_tokens": 200,
                                                               "pad_token_id": 0}}}}]},
    ]
    with RunningMmguard(cfg) as m:
        m.wait_ready()
        yield m


def clip_inputs(batch: int = 1) -> list[Any]:
    return [t("pixel_values", f32(batch, 3, 224, 224)),
            t("input_ids", np.ones((batch, 77), np.int64))]


@pytest.mark.parametrize(("tensors", "check", "message"), [
    ([t("pixels", f32(1, 3, 224, 224)), t("input_ids", np.ones((1, 77), np.int64))],
     "unknown-input", "model 'clip_demo' has no input 'pixels'"),
    ([t("pixel_values", f32(1, 3, 224, 224))],
     "missing-input", "model 'clip_demo' needs input 'input_ids' (INT64 [-1, 77])"),
    ([t("pixel_values", f32(1, 3, 224, 224).astype(np.float64)),
      t("input_ids", np.ones((1, 77), np.int64))],
     "datatype", "input 'pixel_values' is FP64; model 'clip_demo' expects FP32"),
    ([t("pixel_values", f32(3, 224, 224)), t("input_ids", np.ones((1, 77), np.int64))],
     "rank", "input 'pixel_values' has shape [3, 224, 224] (rank 3); model 'clip_demo' expects"),
    ([t("pixel_values", f32(1, 3, 256, 256)), t("input_ids", np.ones((1, 77), np.int64))],
     "dims", "(dim 2 is 256, not 224: it would be cut or refused)"),
    (clip_inputs(9), "batch", "batch of 9 is larger than model 'clip_demo' takes "
                              "(max_batch_size 8)"),
    ([t("pixel_values", f32(2, 3, 224, 224)), t("input_ids", np.ones((1, 77), np.int64))],
     "batch-agree", "inputs disagree on the batch size: {'pixel_values': 2, 'input_ids': 1}"),
])
def test_request_checks_reject_with_the_exact_mismatch(ort: RunningMmguard, tensors: list[Any],
                                                       check: str, message: str) -> None:
    err = refused(ort.grpc_url, "clip_guarded", tensors)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    trailers = dict(err.trailing_metadata())
    assert trailers[f"mmguard-shape-{check}"].startswith("reject")
    assert trailers["mmguard-error-origin"] == "mmguard"  # stopped before the backend


def test_without_the_guard_onnxruntime_takes_a_too_long_text(ort: RunningMmguard) -> None:
    ids = np.zeros((1, 100), np.int64)
    ids[0, :90] = np.arange(1, 91)
    resp, _ = answer(ort.grpc_url, "text_encoder", [t("input_ids", ids)])  # silently "fine"
    assert output(resp, "text_embeds").shape == (1, 8)
    err = refused(ort.grpc_url, "text_guarded", [t("input_ids", ids)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("input 'input_ids' has 90 tokens (element 0); model 'text_encoder' "
                             "reads 77 and would silently drop 13")


def test_padding_past_the_limit_loses_nothing_and_passes(ort: RunningMmguard) -> None:
    ids = np.zeros((2, 100), np.int64)
    ids[:, :50] = 5
    resp, trailers = answer(ort.grpc_url, "text_guarded", [t("input_ids", ids)])
    assert output(resp, "text_embeds").shape == (2, 8)
    assert not any(k.startswith("mmguard-shape") for k in trailers)


def test_truncate_is_announced_and_equals_the_cut_request(ort: RunningMmguard) -> None:
    ids = np.zeros((1, 100), np.int64)
    ids[0, :90] = np.arange(1, 91)
    resp, trailers = answer(ort.grpc_url, "text_truncate", [t("input_ids", ids)])
    assert trailers["mmguard-shape-tokens"].startswith("truncate; input 'input_ids' has 90")
    cut = ids.copy()
    cut[0, 77:] = 0
    ref, _ = answer(ort.grpc_url, "text_encoder", [t("input_ids", cut)])
    np.testing.assert_array_equal(output(resp, "text_embeds"), output(ref, "text_embeds"))


def test_reroute_to_a_route_whose_contract_fits(ort: RunningMmguard) -> None:
    ids = np.zeros((1, 100), np.int64)
    ids[0, :90] = np.arange(1, 91)
    resp, trailers = answer(ort.grpc_url, "text_reroute", [t("input_ids", ids)])
    assert trailers["mmguard-shape-tokens"].startswith("reroute")
    assert "sent to 'text_long'" in trailers["mmguard-shape-tokens"]
    assert output(resp, "text_embeds").shape == (1, 8)
    ids = np.full((1, 300), 3, np.int64)  # too long for text_long as well
    err = refused(ort.grpc_url, "text_reroute", [t("input_ids", ids)])
    assert err.details() == ("input 'input_ids' has 300 tokens (element 0); model "
                             "'text_encoder' reads 200 and would silently drop 100")
    assert dict(err.trailing_metadata())["mmguard-shape-tokens"].startswith("reject")


def test_http_front_gets_the_same_refusal(ort: RunningMmguard) -> None:
    body, hlen = http_binary_body(clip_inputs(9))
    status, headers, resp = http_post(ort.http_url, "/v2/models/clip_guarded/infer", body,
                                      {"Inference-Header-Content-Length": str(hlen)})
    assert status == 400 and "max_batch_size 8" in json.loads(resp)["error"]
    assert headers["mmguard-shape-batch"].startswith("reject")


# --- Triton (fixed dims, max_batch_size 4, a text encoder that cuts at 77) ------------------


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def trit(triton: TritonServer, tokenizer_json: Path) -> Iterator[RunningMmguard]:
    cfg = triton_routes(triton, ["batch4_fp32", "clip_text_trunc"])
    cfg["contract_refresh_s"] = 0.2
    cfg["models"] += [
        {"name": "split4", "backend": "triton-grpc", "backend_model": "batch4_fp32",
         "filters": [{"shape_guard": {"on_batch": "split", "split_concurrency": 2}}]},
        {"name": "strict4", "backend": "triton-grpc", "backend_model": "batch4_fp32",
         "filters": [{"shape_guard": {}}]},
        {"name": "clip_text", "backend": "triton-grpc", "backend_model": "clip_text_trunc",
         "filters": [{"shape_guard": {"inputs": {"text": {"max_tokens": 77,
                                                          "tokenizer": "whitespace"}}}}]},
        {"name": "clip_text_hf", "backend": "triton-http", "backend_model": "clip_text_trunc",
         "filters": [{"shape_guard": {"inputs": {"text": {"max_tokens": 77,
                                                          "tokenizer": str(tokenizer_json)}}}}]},
    ]
    with RunningMmguard(cfg) as m:
        m.wait_ready(timeout=60)
        yield m


@pytest.mark.triton
def test_split_equals_single_requests_in_order(trit: RunningMmguard,
                                               triton: TritonServer) -> None:
    x = f32(10, 16, seed=3)
    resp, trailers = answer(trit.grpc_url, "split4", [t("x", x)])
    assert trailers["mmguard-shape-batch"].startswith("split; batch of 10 is larger")
    assert list(resp.outputs[0].shape) == [10, 16]
    singles = []
    direct = grpcclient.InferenceServerClient(triton.grpc_url)
    for row in x:
        inp = grpcclient.InferInput("x", [1, 16], "FP32")
        inp.set_data_from_numpy(row[None, :])
        singles.append(direct.infer("batch4_fp32", [inp]).as_numpy("y"))
    np.testing.assert_array_equal(output(resp, "y"), np.concatenate(singles))
    with pytest.raises(InferenceServerException, match="batch-size must be <= 4"):
        inp = grpcclient.InferInput("x", [10, 16], "FP32")
        inp.set_data_from_numpy(x)
        direct.infer("batch4_fp32", [inp])  # what the guard spares the client


@pytest.mark.triton
def test_batch_reject_names_the_limit(trit: RunningMmguard) -> None:
    err = refused(trit.grpc_url, "strict4", [t("x", f32(10, 16))])
    assert "batch of 10 is larger than model 'batch4_fp32' takes (max_batch_size 4)" \
        in err.details()


@pytest.mark.triton
@pytest.mark.parametrize("route", ["clip_text", "clip_text_hf"])
def test_text_that_the_encoder_would_cut_is_stopped(trit: RunningMmguard, route: str) -> None:
    text = " ".join(f"w{i}" for i in range(100)).encode()
    tensors = [("text", "BYTES", [1, 1], len(text).to_bytes(4, "little") + text)]
    silent, _ = answer(trit.grpc_url, "g_clip_text_trunc", tensors)
    assert output(silent, "tokens_read", "<i4")[0, 0] == 77  # Triton's model cut it, no word
    err = refused(trit.grpc_url, route, tensors)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("input 'text' has 100 tokens (element 0); model 'clip_text_trunc' "
                             "reads 77 and would silently drop 23")
    short = b"w1 w2 w3"
    ok, _ = answer(trit.grpc_url, route,
                   [("text", "BYTES", [1, 1], len(short).to_bytes(4, "little") + short)])
    assert output(ok, "tokens_read", "<i4")[0, 0] == 3


@pytest.mark.triton
def test_a_model_reload_with_new_dims_is_noticed_and_used(tmp_path: Path) -> None:
    # A Triton of its own: reloading a model with another config must not touch the server
    # that the rest of the session shares.
    repo = write_model_repository(tmp_path / "repo", ensure_clip_demo(tmp_path / "onnx"))
    with TritonServer(repo, tmp_path / "work", load_models=["batch4_fp32"]) as own:
        cfg = {"backends": [{"kind": "triton_grpc", "name": "own", "url": own.grpc_url}],
               "contract_refresh_s": 0.2,
               "models": [{"name": "strict4", "backend": "own", "backend_model": "batch4_fp32",
                           "filters": [{"shape_guard": {}}]}]}
        with RunningMmguard(cfg) as m:
            m.wait_ready(timeout=60)
            assert answer(m.grpc_url, "strict4", [t("x", f32(1, 16))])[0].outputs
            config = {"name": "batch4_fp32", "backend": "python", "max_batch_size": 4,
                      "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [8]}],
                      "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [8]}]}
            own.load_model("batch4_fp32", config=config)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                contract = m.server.plane.runtime.contracts["strict4"]  # type: ignore[union-attr]
                if contract.inputs[0].dims == (-1, 8):
                    break
                time.sleep(0.1)
            err = refused(m.grpc_url, "strict4", [t("x", f32(1, 16))])
            assert "expects [-1, 8] (dim 1 is 16, not 8" in err.details()
            assert dict(err.trailing_metadata())["mmguard-error-origin"] == "mmguard"
            assert answer(m.grpc_url, "strict4", [t("x", f32(1, 8))])[0].outputs


# --- answers outside the contract (a hand-written backend that garbles on cue) ---------------


def test_an_answer_outside_the_contract_is_never_passed_on() -> None:
    with FakeV2() as fake:
        cfg = {"backends": [{"kind": "triton_grpc", "name": "fake",
                             "url": f"127.0.0.1:{fake.grpc_port}"}],
               "models": [{"name": "echo", "backend": "fake"},
                          {"name": "echo_guarded", "backend": "fake", "backend_model": "echo",
                           "filters": [{"shape_guard": {}}]}]}
        with RunningMmguard(cfg) as m:
            m.wait_ready()
            x = [t("INPUT0", np.arange(4, dtype=np.float32))]
            assert answer(m.grpc_url, "echo_guarded", x)[0].raw_output_contents
            fake.garble = True  # 12 bytes for 4 floats
            # Bytes that do not fit their shape are refused where the answer is decoded, on
            # every route (proxy.wire.answers), guarded or not, before any filter sees them.
            for route in ("echo", "echo_guarded"):
                err = refused(m.grpc_url, route, x)
                assert err.code() == grpc.StatusCode.INTERNAL
                assert "answered outside its contract" in err.details()
                assert "FP32 shape [4] needs 16 bytes, got 12" in err.details()
