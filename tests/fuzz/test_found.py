"""What the fuzzers found, one minimal reproduction each (shrunk by hypothesis, then trimmed).

Each test states the refusal mmguard now gives — its kind (or over sockets its HTTP status /
gRPC code) and what its message says: the input at fault, what was expected, what came — for an
input on which mmguard once did something else (a 500, an INTERNAL, a silently changed value).
``refuses`` (``tests/fuzz/oracle.py``) fails on an accepted input and on a vague refusal alike,
so none of these passes with a decoder that accepts everything. The comment over each says where
the bug was; all are fixed, and these keep them fixed.
"""

from __future__ import annotations

import base64
import json

import grpc
import pytest

from proxy.call import Call
from proxy.errors import ErrorKind, ProxyError
from proxy.tensor import MAX_SPAN
from proxy.wire import kserve_grpc, kserve_http, openai
from tests.fuzz.fronts import Client, refused_over_grpc, refused_over_http
from tests.fuzz.openai_inputs import bombs
from tests.fuzz.oracle import decodes_or_refuses, refuses
from tests.support.wire import grpc_request

DEEP = b"[" * 5_000
V2_INFER = "/v2/models/identity_fp32/infer"
UNKNOWN_IN = "model 'identity_fp32' expects inputs ['INPUT0']; unknown: ['IN']; missing: ['INPUT0']"


def _v2(**overrides: object) -> bytes:
    item = {"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1, 2]}
    doc: dict[str, object] = {"inputs": [{**item, **overrides.pop("input", {})}]}  # type: ignore
    doc.update(overrides)
    return json.dumps(doc).encode()


def _http(body: bytes) -> Call | None:
    return decodes_or_refuses(kserve_http.decode_request, body, None, "m", "")


def _http_refuses(body: bytes, *says: str) -> ProxyError:
    return refuses(kserve_http.decode_request, body, None, "m", "", says=says)


def _openai_refuses(doc: object, *says: str, endpoint: str = openai.CHAT) -> ProxyError:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return refuses(openai.decode_request, body, endpoint, frozenset(), says=says)


def _image_refuses(part: openai.ImagePart, kind: ErrorKind, *says: str) -> None:
    refuses(part.array, kind=kind, says=("messages[0].content[0].image_url: ", *says))


# --- proxy/wire/kserve_http.py
# ------------------------------------------------------------------------


def test_deeply_nested_v2_json_is_400() -> None:
    # split_body: json.loads raises RecursionError, caught as neither ValueError nor
    # UnicodeDecodeError; the HTTP front answers a bare aiohttp 500.
    _http_refuses(DEEP, "the JSON in the request body is nested too deeply")


@pytest.mark.parametrize("datatype", [[], {}])
def test_unhashable_datatype_is_400(datatype: object) -> None:
    # _decode_input: `datatype not in DATATYPES` raised TypeError for a list or an object.
    # Triton reads 'datatype' as a string, and says so.
    _http_refuses(_v2(input={"datatype": datatype}),
                  "Unable to parse 'datatype': attempt to access JSON non-string as string "
                  f"(input 'INPUT0': 'datatype' is {datatype!r})")


@pytest.mark.parametrize("params", [5, "ab", [1]])
def test_output_parameters_not_an_object_is_400(params: object) -> None:
    # decode_request: `dict(o.get("parameters") or {})` raises TypeError / ValueError.
    _http_refuses(_v2(outputs=[{"name": "OUTPUT0", "parameters": params}]),
                  "output 'OUTPUT0': 'parameters' must be an object, got "
                  f"{type(params).__name__}")


def test_json_data_null_is_400() -> None:
    # _decode_input takes `"data": null` as data; Tensor.to_raw then fails `assert self.data is
    # not None` (proxy/tensor.py) → AssertionError → 500.
    _http_refuses(_v2(input={"data": None}), "Unable to parse 'data': attempt to access JSON "
                  "non-array as array (input 'INPUT0': 'data' is NoneType)")


@pytest.mark.parametrize("datatype,value", [("UINT8", 256), ("INT8", -129)])
def test_json_integer_out_of_range_is_400_not_wrapped(datatype: str, value: int) -> None:
    # Tensor.to_raw (proxy/tensor.py): numpy 1.26 wraps 256 to 0 for UINT8 with only a
    # DeprecationWarning, so the model gets another value than the client sent (numpy 2 raises
    # OverflowError, which _check_json_data turns into a 400). Triton wraps too; mmguard refuses.
    _http_refuses(_v2(input={"datatype": datatype, "shape": [1], "data": [value]}),
                  f"input 'INPUT0': data does not fit {datatype}: {value} is outside [")


def test_json_negative_unsigned_is_refused_in_tritons_words() -> None:
    _http_refuses(_v2(input={"datatype": "UINT32", "shape": [1], "data": [-1]}),
                  "Unable to parse 'data': attempt to access JSON non-unsigned-integer as "
                  "unsigned-integer (input 'INPUT0' is UINT32; its element 0 is -1)")


@pytest.mark.parametrize("shape", [[0, 2**62], [2**62, 0, 2]])
def test_shape_with_a_zero_and_a_huge_dim_is_refused_or_usable(shape: list[int]) -> None:
    # Tensor.check_payload passes (0 elements, 0 bytes) but no array has that shape: numpy
    # raises ValueError in Tensor.numpy(), which the ONNX Runtime backend's _feed calls (see the
    # socket test below).
    _http_refuses(_v2(input={"shape": shape, "data": []}),
                  f"input 'INPUT0': shape {shape} has a dim above 2147483647")


def test_a_dim_past_64_bits_is_refused_in_tritons_words() -> None:
    # [0, 10**30] does not even fit the uint64 Triton reads a dim as.
    _http_refuses(_v2(input={"shape": [0, 10**30], "data": []}),
                  "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
                  "unsigned-integer (input 'INPUT0': 'shape' is [0, ")


@pytest.mark.parametrize("shape", [[0, 115, 12484608, 1606057984], [2**30, 0, 2**30, 2],
                                   [0, 2**30, 2**30]])
def test_shape_with_a_zero_and_dims_that_multiply_past_any_array_is_refused(
        shape: list[int]) -> None:
    # Each dim is within MAX_DIM, yet their product (the zero aside) passes what numpy takes:
    # Tensor.numpy() raised ValueError("array is too big") for an accepted call (found by the
    # long fuzz run on the gRPC decoder, 7 December 2026).
    message = (f"input 'INPUT0': shape {shape} has a zero dim, but its other dims multiply "
               f"past {MAX_SPAN}: no array takes that shape, even with 0 elements")
    _http_refuses(_v2(input={"shape": shape, "data": []}), message)
    refuses(kserve_grpc.decode_request, grpc_request("m", [("INPUT0", "FP32", shape, b"")]),
            says=[message])


def test_shape_with_a_zero_and_dims_just_within_the_span_bound_is_usable() -> None:
    shape = [0, 2**30, 2**30 - 1]  # 2**60 - 2**30 elements without the zero: within MAX_SPAN
    for datatype in ("FP64", "BYTES"):
        call = kserve_grpc.decode_request(grpc_request("m", [("INPUT0", datatype, shape, b"")]))
        assert call.inputs[0].numpy().shape == tuple(shape)


# --- proxy/wire/openai.py ------------------------------------------------------------------------


def test_deeply_nested_openai_json_is_400() -> None:
    # decode_request: json.loads raises RecursionError (same as split_body above).
    _openai_refuses(DEEP, "the JSON in the request body is nested too deeply")


def test_bracketed_host_that_does_not_close_is_400() -> None:
    # check_image_url: urlsplit raises ValueError("Invalid IPv6 URL").
    _openai_refuses({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://[::1/x.png"}}]}]},
        "messages[0].content[0].image_url.url: not a valid URL (Invalid IPv6 URL)")


def test_completions_with_messages_not_a_list_reads_the_prompt_only() -> None:
    # decode_request checks 'messages' only for chat; ChatView._parts then iterated `true`.
    # vLLM ignores 'messages' beside a completion's prompt; mmguard drops them.
    call = openai.parse_request(json.dumps({"model": "m", "prompt": "a", "messages": True})
                                .encode(), openai.COMPLETIONS)
    assert call.document is not None and "messages" not in call.document
    assert call.wire is None  # written anew, without them
    assert openai.ChatView(call).texts() == ["a"]


@pytest.mark.parametrize("prompt", [False, 5])
def test_texts_of_a_prompt_that_is_no_string_or_list(prompt: object) -> None:
    # ChatView.texts iterates a prompt that is neither a string nor a list: TypeError in the
    # filters that read texts (quality, shape_guard, modality_router) → INTERNAL.
    # Fixed by refusing it at decode.
    _openai_refuses({"model": "m", "prompt": prompt},
                    "'prompt' must be a string, a list of strings or a list of token ids",
                    endpoint=openai.COMPLETIONS)


def test_texts_are_strings() -> None:
    # ChatView.texts returns a text part's "text" as it is: [5] here, for filters that expect str.
    # Fixed by refusing it at decode (400 naming messages[0].content[0].text); a call that is
    # accepted must give strings.
    _openai_refuses({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, "messages[0].content[0].text must be a string")


def _image(data: bytes, mime: str = "image/png") -> openai.ImagePart:
    return openai.ImagePart(0, 0, f"data:{mime};base64,{base64.b64encode(data).decode()}")


def test_png_declaring_400_megapixels_is_400() -> None:
    # ImagePart.array: PIL raises DecompressionBombError (not an OSError) for a 67-byte PNG
    # whose header says 20,000 × 20,000; the quality filter crashes → INTERNAL.
    _image_refuses(_image(bombs()[0]), ErrorKind.TOO_LARGE, "400000000 pixels")


def test_small_png_of_90_megapixels_is_refused_before_decoding() -> None:
    # ImagePart.array: an 11 KB 1-bit PNG of 9,500 × 9,500 is under PIL's refusal threshold
    # (179 Mpx) and gets only a DecompressionBombWarning: it is decoded into a 270 MB RGB array
    # (about 1 GB peak RSS measured with an 8-bit variant). mmguard needs its own pixel limit.
    _image_refuses(_image(bombs()[3]), ErrorKind.TOO_LARGE, "90250000 pixels")


def test_png_with_a_cut_header_chunk_is_400() -> None:
    # ImagePart.array: Image.open raises ValueError("Truncated IHDR chunk"), not an OSError.
    _image_refuses(_image(base64.b64decode("iVBORw0KGgoAAAAESUhEUgAAAAc=")),
                   ErrorKind.INVALID_ARGUMENT, "not a decodable image: Truncated IHDR chunk")


def test_png_with_a_broken_chunk_is_400() -> None:
    # ImagePart.array: PIL's PNG decoder raises SyntaxError("broken PNG file") for a chunk name
    # cut by one byte.
    _image_refuses(_image(base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAcAAAAFCAIAAAAG+GGPAAAADElEQVR4nGNYYKAnAAAAbgABSF16YwAAAABJRU5E"
        "rkJggg==")), ErrorKind.INVALID_ARGUMENT, "not a decodable image: broken PNG file")


def test_gif_with_a_frame_outside_the_image_is_400() -> None:
    # ImagePart.array: PIL raises ValueError("tile cannot extend outside image"), which is not
    # caught (only UnidentifiedImageError and OSError are).
    gif = base64.b64decode("R0lGODdhBwAFAIAAAAAAAAAAACxhBwAFAIAAAAAAAAAAACwAAAAABwAFAAAIDAABCBx"
                           "IsKDBgwcDAgA7")
    # Now refused before decoding, by its declared size (34657 × 1280 is over mmguard's limit).
    _image_refuses(_image(gif, "image/gif"), ErrorKind.TOO_LARGE,
                   "the image is 34657×1280 = 44360960 pixels; mmguard decodes at most")


# --- over sockets: proxy/backends/onnxruntime.py ------------------------------------------------


def test_unknown_input_name_is_400_on_http(fuzz_client: Client) -> None:
    # _run maps an onnxruntime error to INVALID_ARGUMENT only when its text says so; "Required
    # inputs (['INPUT0']) are missing from input feed (['IN'])" is a ValueError from
    # onnxruntime's Python wrapper and becomes INTERNAL → HTTP 500.
    refused_over_http(fuzz_client, V2_INFER, _v2(input={"name": "IN"}), 400, [UNKNOWN_IN])


def test_unknown_input_name_is_invalid_argument_on_grpc(fuzz_client: Client) -> None:
    # Same as above over gRPC: INTERNAL instead of INVALID_ARGUMENT.
    refused_over_grpc(fuzz_client, grpc_request("identity_fp32", [("IN", "FP32", [1], b"\0" * 4)]),
                      grpc.StatusCode.INVALID_ARGUMENT, [UNKNOWN_IN])


def test_bf16_beside_bytes_input_is_invalid_argument(fuzz_client: Client) -> None:
    # With a BF16 input _run feeds OrtValues; the BYTES one cannot become an OrtValue ("Creation
    # of OrtValues is currently only supported from non-string numpy arrays") → INTERNAL.
    refused_over_grpc(fuzz_client, grpc_request("identity_fp32", [
        ("A", "BF16", [1], b"\0\0"), ("B", "BYTES", [1], b"\0\0\0\0")]),
        grpc.StatusCode.INVALID_ARGUMENT,
        ["model 'identity_fp32' expects inputs ['INPUT0']; unknown: ['A', 'B']"])


def test_chat_to_an_onnxruntime_model_is_a_client_error(fuzz_client: Client) -> None:
    # An OpenAI request routed to a v2 model reaches ONNX Runtime with no inputs: the same
    # "Required inputs ... are missing" ValueError → 500 (mmguard could refuse it at once:
    # the route's backend does not speak OpenAI).
    chat = {"model": "clip_demo", "messages": [{"role": "user", "content": "hi"}]}
    refused_over_http(fuzz_client, openai.CHAT, json.dumps(chat).encode(), 400,
        ["model 'clip_demo' is served over KServe v2 by backend 'ort'; call it through the "
         "KServe v2 (/v2/models/…/infer or gRPC) front"], openai=True)


def test_zero_and_huge_dim_is_a_client_error_over_grpc(fuzz_client: Client) -> None:
    # The shape passes decode_request; _feed's Tensor.numpy() raises ValueError("array is too
    # big"); the chain wraps it as "filter 'limits' failed" (proxy/chain.py _step blames the
    # innermost filter for the backend's exception) → INTERNAL.
    refused_over_grpc(fuzz_client, grpc_request("identity_fp32",
                                                [("INPUT0", "FP32", [0, 2**62], b"")]),
                      grpc.StatusCode.INVALID_ARGUMENT,
                      ["input 'INPUT0': shape [0, 4611686018427387904] has a dim above 2147483647"])


def test_deep_json_is_a_json_400_on_both_http_fronts(fuzz_client: Client) -> None:
    refused_over_http(fuzz_client, V2_INFER, DEEP, 400,
                      ["the JSON in the request body is nested too deeply"])
    refused_over_http(fuzz_client, openai.CHAT, DEEP, 400,
                      ["the JSON in the request body is nested too deeply"], openai=True)


# --- found by a 3-minute scripts/fuzz_long.py run after the fixes above --------------------------


def test_outputs_not_a_list_is_400() -> None:
    # decode_request iterated `"outputs": 1` → TypeError → a bare 500 on the HTTP front.
    _http_refuses(_v2(outputs=1), "Unable to parse 'outputs': attempt to access JSON non-array "
                  "as array ('outputs' is int)")


@pytest.mark.parametrize("datatype", ["BF16", "FP16"])
def test_json_bf16_and_fp16_are_refused_in_tritons_words(datatype: str) -> None:
    # Tensor.to_raw cast JSON BF16 numbers to uint16 (0.5 → 0); then it kept them as numbers,
    # where Triton refuses both datatypes in JSON (a number cannot say which 16 bits it is).
    _http_refuses(_v2(input={"datatype": datatype, "shape": [3], "data": [0.5, 1.0, -2.25]}),
                  f"receiving {datatype} data via JSON is not supported. Please use the binary "
                  "data format for input INPUT0")


def test_json_float_past_fp32_is_inf_as_tritons_cast_makes_it() -> None:
    # Refused once (numpy's cast makes inf with only a RuntimeWarning); Triton casts the double
    # and the model sees inf (tests/conformance/test_triton_json_data.py), so does mmguard's.
    call = _http(_v2(input={"datatype": "FP32", "shape": [2], "data": [1e300, -1e39]}))
    assert call is not None
    assert call.inputs[0].numpy().tolist() == [float("inf"), float("-inf")]


def test_lone_surrogates_and_int64_overflow_in_names_and_parameters_are_400() -> None:
    # A JSON call re-encoded for a gRPC backend hit UnicodeEncodeError / ValueError in
    # kserve_grpc.params_to_pb: JSON may carry "\ud800" and integers past int64.
    _http_refuses(b'{"inputs": [{"name": "\\ud800x", "datatype": "FP32", "shape": [1], '
                  b'"data": [1]}]}', "inputs[0].name is not valid Unicode text")
    _http_refuses(_v2(parameters={"\ud800": 1}),
                  "the request: a parameter name is not valid Unicode text")
    _http_refuses(_v2(outputs=[{"name": "o", "parameters": {"k": 2**63}}]),
                  "output 'o': parameter 'k' is 9223372036854775808, outside the int64 range")
    _http_refuses(_v2(parameters={"k": [1]}), "parameter 'k' has invalid type. It should be "
                  "either 'int', 'bool', or 'string'.")  # Triton's words


@pytest.mark.parametrize("data,came", [([-1, None, 0], "element 0 is -1"),
                                       ([1.5], "element 0 is 1.5"),
                                       ([1, 1e3], "element 1 is 1000.0"),
                                       ([True], "element 0 is True"),
                                       (["7"], "element 0 is '7'")])
def test_json_integers_that_are_not_whole_numbers_in_range_are_400(data: list[object],
                                                                   came: str) -> None:
    # found by a later CI run: with a null among them, the range check was skipped (numpy made
    # an object array) and -1 reached UINT16 with a numpy warning; 1.5 was silently cut to 1.
    # Triton reads an integer literal only (1e3 is a double to it), in its words.
    _http_refuses(_v2(input={"datatype": "UINT16", "shape": [len(data)], "data": data}),
                  "Unable to parse 'data': attempt to access JSON non-unsigned-integer as "
                  f"unsigned-integer (input 'INPUT0' is UINT16; its {came})")
