"""KServe v2 HTTP/REST (JSON and the binary tensor extension) ↔ ``Call`` / ``Result``.

Binary tensors are memoryview slices of the request body, never copied on the way in. An unedited
call to an HTTP backend is forwarded as its original body; a call that crossed protocols or was
edited is re-encoded with every tensor binary (raw to raw). Responses are encoded the way the
client asked: ``binary_data`` per output, ``binary_data_output`` for all, JSON otherwise.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.call import Call, CallKey, Decoded, RequestedOutput, Result, Wire
from proxy.errors import ErrorKind, ProxyError, bounded
from proxy.tensor import (
    DATATYPES,
    MAX_PARAMETERS,
    MAX_RANK,
    MAX_TENSORS,
    Payload,
    Tensor,
    encode_bytes_elements,
    flatten,
    json_bytes,
)
from proxy.wire import json_data
from proxy.wire import triton_json as typed
from proxy.wire.answers import answer_error, output_problem
from proxy.wire.json_floats import FLOAT_TYPES, Spliced
from proxy.wire.kserve_raw import check_byte_size, header_length_value
from proxy.wire.numbers import NumberTooBig, json_loads

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


WRITTEN: CallKey[frozenset[str]] = CallKey("shm_written_outputs")
"""Names of the outputs written into the client's regions: the HTTP encoder sends no bytes for
them (the gRPC one sends empty raw contents, as Triton does)."""


def bad(message: str) -> ProxyError:
    return ProxyError(ErrorKind.INVALID_ARGUMENT, message)


def split_body(body: bytes, header_length: str | None,
               what: str = "request") -> tuple[dict[str, Any], int | None]:
    """Parse the JSON part of a v2 body; returns it and the binary offset (None: JSON only)."""
    hlen: int | None = None
    if header_length is not None:
        hlen = header_length_value(header_length, len(body))
    head: bytes | str = body if hlen is None else body[:hlen]
    if what == "response":  # Triton writes a BYTES output that is not UTF-8 as it is
        head = bytes(body if hlen is None else body[:hlen]).decode("utf-8", "surrogateescape")
    try:
        doc = json_loads(head, first_wins=True)  # as Triton reads a repeated key
    except NumberTooBig as exc:
        raise bad(f"failed to parse the {what} JSON buffer: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"failed to parse the {what} JSON buffer: malformed JSON in the {what} body: "
                  f"{exc}") from None
    except RecursionError:
        raise bad(f"failed to parse the {what} JSON buffer: the JSON in the {what} body is "
                  "nested too deeply") from None
    if not isinstance(doc, dict):
        raise bad(f"failed to parse the {what} JSON buffer: the {what} body must be a JSON "
                  f"object, got {type(doc).__name__}")
    return doc, hlen


def decode_request(body: bytes, header_length: str | None, model: str, version: str,
                   content_type: str | None = None, shared_memory: bool = False) -> Call:
    """``shared_memory``: an input in a region becomes an empty placeholder that
    ``proxy.shm.regions`` fills (otherwise it is refused)."""
    doc, hlen = split_body(body, header_length)
    raw_inputs = doc.get("inputs")
    if "id" in doc:
        typed.expect(doc["id"], "string", "Unable to parse 'id'")
    request_id = str(doc.get("id", ""))
    if not isinstance(raw_inputs, list):  # none at all: the backend says which it needs
        raise typed.refused("Unable to parse 'inputs'", "array",
                            "the request needs an 'inputs' list")
    _check_count("'inputs'", len(raw_inputs), MAX_TENSORS, "inputs")
    view = memoryview(body)
    offset = hlen or 0
    inputs = []
    for i, item in enumerate(raw_inputs):
        t, offset = _decode_input(i, item, view, offset, hlen is not None, model,
                                  request_id, shared_memory)
        inputs.append(t)
    if hlen is not None and offset != len(body):
        raise bad(f"unexpected additional input data for model '{model}' (the binary part "
                  f"has {len(body) - hlen} bytes but the inputs declare {offset - hlen} in "
                  "binary_data_size)")
    outputs = []
    requested = doc.get("outputs") or []
    if not isinstance(requested, list):
        raise typed.refused("Unable to parse 'outputs'", "array",
                            f"'outputs' is {type(requested).__name__}")
    _check_count("'outputs'", len(requested), MAX_TENSORS, "outputs")
    for o in requested:
        if not isinstance(o, dict):
            raise bad("each entry of 'outputs' must be an object with a 'name'")
        typed.expect(o.get("name"), "string", "Unable to parse 'name'", "an output's name")
        o_params = o.get("parameters") or {}
        if not isinstance(o_params, dict):
            raise bad(f"output '{o['name']}': 'parameters' must be an object, got "
                      f"{type(o_params).__name__}")
        _check_text(o["name"], "an output name")
        _check_params(f"output '{o['name']}'", o_params)
        typed.check_parameters(o_params, typed.OUTPUT_PARAMETERS, f"output '{o['name']}'")
        outputs.append(RequestedOutput(o["name"], dict(o_params)))
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad("'parameters' must be an object")
    params = _request_params(params)
    _check_text(request_id, "'id'")
    return Call(model=model, version=version, id=request_id, inputs=inputs,
                outputs=outputs, parameters=params, front="http",
                wire=Wire("http", body, hlen, content_type))


def _decode_input(i: int, item: Any, view: memoryview, offset: int, has_binary: bool,
                  model: str, request_id: str,
                  shared_memory: bool = False) -> tuple[Tensor, int]:
    if not isinstance(item, dict):
        raise bad(f"inputs[{i}] must be an object")
    name: Any = item.get("name")  # each checked below, as Triton reads it
    datatype: Any = item.get("datatype")
    shape: Any = item.get("shape")
    typed.expect(name, "string", "Unable to parse 'name'", f"inputs[{i}].name is "
                 f"{bounded(repr(name), 64)}")
    _check_text(name, f"inputs[{i}].name")
    typed.expect(datatype, "string", "Unable to parse 'datatype'",
                 f"input '{name}': 'datatype' is {bounded(repr(datatype), 64)}")
    if datatype not in DATATYPES:
        raise bad(f"invalid datatype for input {name}: unknown datatype "
                  f"{bounded(repr(datatype), 64)} (v2 datatypes: {', '.join(sorted(DATATYPES))})")
    typed.expect(shape, "array", "Unable to parse 'shape'",
                 f"input '{name}': 'shape' is {type(shape).__name__}")
    _check_count(f"input '{name}': 'shape'", len(shape), MAX_RANK, "dims")
    for d in shape:
        typed.expect(d, "uint", "Unable to parse 'shape'",
                     f"input '{name}': 'shape' is {bounded(repr(shape), 64)}")
    params = item.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad(f"input '{name}': 'parameters' must be an object")
    _check_params(f"input '{name}'", {k: v for k, v in params.items()
                                      if k != "binary_data_size"})
    if "shared_memory_region" in params and not shared_memory:
        raise ProxyError(ErrorKind.UNIMPLEMENTED,
                         f"input '{name}' uses shared memory, which this endpoint does not serve")
    _check_content_fields(name, item, params)
    typed.check_parameters(params, typed.INPUT_PARAMETERS, f"input '{name}'")
    if "shared_memory_region" in params:
        return Tensor(name, datatype, tuple(shape), raw=b"", parameters=params), offset
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        typed.expect(size, "uint", "Unable to parse 'binary_data_size'",
                     f"input '{name}': binary_data_size is {bounded(repr(size), 64)}")
        if not has_binary or offset + size > len(view):
            missing = size if not has_binary else offset + size - len(view)
            where = (f"the request has no {HEADER_LENGTH} header" if not has_binary else
                     f"binary_data_size {size} runs past the end of the body "
                     f"({len(view) - offset} bytes left)")
            raise bad(f"unexpected size for input '{name}', expecting {missing} additional "
                      f"bytes for model '{model}' ({where})")
        t = Tensor(name, datatype, tuple(shape), raw=view[offset:offset + size],
                   parameters=params)
        check_byte_size(t, model, request_id)
        offset += size
    else:  # 'data', the one field _check_content_fields leaves
        typed.expect(item["data"], "array", "Unable to parse 'data'",
                     f"input '{name}': 'data' is {type(item['data']).__name__}")
        t = Tensor(name, datatype, tuple(shape), data=item["data"], parameters=params)
        t.check_shape()
        t.data = json_data.elements(t)  # any nesting, ragged too: Triton reads the elements
        typed.check_data(name, datatype, t.data)
        json_data.convert(t)
    t.check_payload((model, request_id))
    return t, offset


_CONTENT_FIELDS = (("data", False), ("binary_data_size", True), ("shared_memory_region", True))


def _check_content_fields(name: str, item: dict[str, Any], params: dict[str, Any]) -> None:
    """Exactly one of 'data', binary_data_size, shared_memory_region, refused in Triton's
    words otherwise."""
    present = [f for f, in_params in _CONTENT_FIELDS if f in (params if in_params else item)]
    if len(present) == 1:
        return
    found = " no field is set" if not present else " set" + "".join(f" '{f}'" for f in present)
    reason = ("it has no data" if not present else "it has its data more than one way; send "
              "it one way")
    raise bad("Input must set only one of the following fields: 'data', 'binary_data_size' in "
              f"'parameters', 'shared_memory_region' in 'parameters'. But{found} (input "
              f"'{name}': {reason})")


def _check_count(where: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise bad(f"{where} has {count} {what}; mmguard takes at most {limit}")


def _check_text(text: str, what: str) -> None:
    """JSON may carry lone surrogates (\\ud800) that no UTF-8 protocol can pass on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"{what} is not valid Unicode text ({exc.reason} at {exc.start})") from None


def _check_params(where: str, params: dict[str, Any],
                  unsigned: frozenset[str] = frozenset()) -> None:
    """v2 parameters are bools, 64-bit integers, numbers or strings (what protobuf can hold);
    ``unsigned``: those read as unsigned 64-bit integers (checked by ``triton_json``)."""
    _check_count(f"{where}: 'parameters'", len(params), MAX_PARAMETERS, "entries")
    for key, value in params.items():
        _check_text(key, f"{where}: a parameter name")
        if isinstance(value, str):
            _check_text(value, f"{where}: parameter '{key}'")
        elif isinstance(value, int) and not isinstance(value, bool):
            if key not in unsigned and not -2**63 <= value < 2**63:
                raise bad(f"{where}: parameter '{key}' is {value}, outside the int64 range")
        elif not isinstance(value, (bool, float)):
            raise bad(f"{where}: parameter '{key}' must be a bool, an integer, a number or a "
                      f"string, got {type(value).__name__}")


def _request_params(params: dict[str, Any]) -> dict[str, Any]:
    """The request's parameters as Triton's HTTP front reads them: its own by their types
    (``triton_json``), any other a bool, a number or a string; an integer past int64 is read as
    a double (the model sees one), as rapidjson reads it."""
    typed.check_request_parameters(params)
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in typed.REQUEST_PARAMETERS and key != "sequence_id":
            if value is None or isinstance(value, (dict, list)):
                raise bad(f"parameter '{key}' has invalid type. It should be either 'int', "
                          f"'bool', or 'string'. (got {type(value).__name__})")
            if type(value) is int and not -2**63 <= value < 2**63:
                value = float(value)
        out[key] = value
    _check_params("the request", out, _UNSIGNED)
    return out


_UNSIGNED = frozenset(k for k, kind in typed.REQUEST_PARAMETERS.items() if kind == "uint") | {
    "sequence_id"}
"""Read as unsigned 64-bit integers: checked by ``triton_json``, not held to int64."""


GRPC_ONLY_PARAMETERS = frozenset({"triton_enable_empty_final_response"})
"""Read by Triton's gRPC front only (for its decoupled streams, which an HTTP backend does not
carry); its HTTP front refuses any ``triton_`` key."""


def encode_request(call: Call) -> tuple[list[Payload], int | None, bool]:
    """Body parts and header length for an HTTP backend; the flag says whether the client's own
    body was forwarded (then the backend's answer is already in the form the client asked for).
    Parts are not joined here: tensors go to the socket from the buffers they arrived in."""
    if call.wire is not None and call.wire.protocol == "http":
        return [call.wire.body], call.wire.header_length, True
    head: dict[str, Any] = {"inputs": []}
    if call.id:
        head["id"] = call.id
    params = {k: v for k, v in call.parameters.items() if k not in GRPC_ONLY_PARAMETERS}
    if params:
        head["parameters"] = params
    chunks: list[Any] = []
    for t in call.inputs:
        raw = t.raw_bytes()
        params = {**t.parameters, "binary_data_size": len(raw)}
        head["inputs"].append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                               "parameters": params})
        chunks.append(raw)
    if call.outputs:
        head["outputs"] = [{"name": o.name, "parameters": {**o.parameters, "binary_data": True}}
                           for o in call.outputs]
    else:
        head.setdefault("parameters", {})["binary_data_output"] = True
    header = json.dumps(head, separators=(",", ":")).encode()
    return [header, *chunks], len(header), False


def decode_response(body: bytes, header_length: str | None, wire_valid: bool,
                    source: str = "backend") -> Result:
    """The answer as a ``Result``; ``wire_valid``: it is already in the form the client asked
    for, so it may go back as it came. Its JSON head is parsed now and every output is checked
    against its shape (``proxy.wire.answers``) before the answer goes anywhere; binary tensors stay
    slices of the body."""
    try:
        doc, hlen = split_body(body, header_length, "response")
    except ProxyError as err:
        raise ProxyError(ErrorKind.BAD_GATEWAY, f"{source} sent a malformed v2 response: {err}",
                         origin="backend") from None
    view = memoryview(body)
    entries = _response_outputs(doc, hlen, view, source)

    def decode() -> Decoded:
        return Decoded(str(doc.get("model_name", "")), str(doc.get("model_version", "")),
                       str(doc.get("id", "")), dict(doc.get("parameters") or {}), outputs())

    def outputs() -> list[Tensor]:
        out = []
        for o, params, start, size in entries:
            shape = tuple(o["shape"])
            if size is not None:
                out.append(Tensor(o["name"], o["datatype"], shape,
                                  raw=view[start:start + size], parameters=params))
            elif o["datatype"] == "BYTES":  # its text's bytes, those not UTF-8 included
                out.append(Tensor(o["name"], "BYTES", shape, parameters=params,
                                  raw=encode_bytes_elements([
                                      x.encode("utf-8", "surrogateescape") if isinstance(x, str)
                                      else x for x in flatten(o.get("data", []))])))
            else:
                t = Tensor(o["name"], o["datatype"], shape, data=o.get("data", []),
                           parameters=params)
                t.raw, t.data = t.to_raw(), None
                out.append(t)
        return out

    wire = Wire("http", body, hlen, head=doc) if wire_valid else None
    return Result(wire=wire, decode=decode)


_Entry = tuple[dict[str, Any], dict[str, Any], int, int | None]


def _response_outputs(doc: dict[str, Any], hlen: int | None, view: memoryview,
                      source: str) -> list[_Entry]:
    """Each output with its parameters and where its binary bytes lie; refuses (INTERNAL) an
    output whose bytes do not fit its shape, or a binary part that does not add up."""
    body_size = len(view)
    raw_outputs = doc.get("outputs") or []
    if not isinstance(raw_outputs, list):
        raise answer_error(source, f"'outputs' is a {type(raw_outputs).__name__}, not a list")
    offset = hlen or 0
    entries: list[_Entry] = []
    for i, o in enumerate(raw_outputs):
        if not (isinstance(o, dict) and isinstance(o.get("name"), str)
                and isinstance(o.get("datatype"), str) and isinstance(o.get("shape"), list)
                and all(type(d) is int for d in o["shape"])):
            raise answer_error(source, f"outputs[{i}] is not an object with a name, a "
                               "datatype and a list of integer dims")
        params = dict(o.get("parameters") or {})
        size = params.pop("binary_data_size", None)
        shape = tuple(o["shape"])
        if size is not None:
            if hlen is None and size != 0:  # with no binary bytes, Triton sends no header
                raise answer_error(source, f"output '{o['name']}' has binary_data_size but the "
                                   f"answer has no {HEADER_LENGTH} header")
            if type(size) is not int or size < 0 or offset + size > body_size:
                raise answer_error(source, f"output '{o['name']}': binary_data_size {size!r} "
                                   f"runs past the end of the body ({body_size - offset} bytes "
                                   "left)")
            problem = output_problem(o["name"], o["datatype"], shape,
                                     view[offset:offset + size])
        else:
            data = o.get("data", [])
            problem = (f"output '{o['name']}': 'data' is a {type(data).__name__}, not a list"
                       if not isinstance(data, list)
                       else output_problem(o["name"], o["datatype"], shape, None, data))
        if problem is not None:
            raise answer_error(source, problem)
        entries.append((o, params, offset, size))
        offset += size or 0
    if hlen is not None and offset != body_size:
        raise answer_error(source, f"the binary part has {body_size - hlen} bytes but the "
                           f"outputs declare {offset - hlen} (binary_data_size)")
    return entries


NO_JSON_OUTPUT = frozenset({"FP16", "BF16"})
"""Datatypes Triton's HTTP server refuses to answer as JSON data (seen from Triton 2.51)."""


def encode_response(call: Call, result: Result) -> tuple[bytes, int | None]:
    if result.wire is not None and result.wire.protocol == "http":
        wire = result.wire
        if call.target is None or call.target.model == call.model:
            return wire.body, wire.header_length
        # Renamed route: rewrite the small JSON header only; binary tensors stay as they are.
        end = wire.header_length if wire.header_length is not None else len(wire.body)
        renamed = dict(wire.head) if wire.head is not None else json.loads(
            bytes(wire.body[:end]).decode("utf-8", "surrogateescape"))
        renamed["model_name"] = call.model
        header = json_bytes(renamed)
        if wire.header_length is None:
            return header, None
        return header + memoryview(wire.body)[end:], len(header)
    want_binary_all = bool(call.parameters.get("binary_data_output", False))
    asked = {o.name: o.parameters for o in call.outputs}
    head: dict[str, Any] = {}
    if call.id or result.id:  # first, where Triton puts it: the same bytes as from Triton
        head["id"] = call.id or result.id
    head.update({"model_name": call.model, "model_version": result.version, "outputs": []})
    if result.parameters:
        head["parameters"] = result.parameters
    chunks: list[Any] = []
    floats = Spliced()  # float tensors written as Triton writes them (json_floats)
    in_regions = call.state.get(WRITTEN) or frozenset()
    for t in result.outputs:
        binary = asked.get(t.name, {}).get("binary_data", want_binary_all)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if t.name in in_regions:  # written into the client's shared memory: no bytes here
            head["outputs"].append(entry)
            continue
        params = {k: v for k, v in t.parameters.items() if k != "binary_data_size"}
        if binary:
            raw = t.raw_bytes()
            params["binary_data_size"] = len(raw)
            chunks.append(raw)
        elif t.datatype in NO_JSON_OUTPUT:
            # Triton refuses these as JSON (400) whichever backend answered: so does mmguard,
            # so a client gets the same answer through every route and directly.
            raise bad(f"sending {t.datatype} data via JSON is not supported. Please use the "
                      f"binary data format for output (output '{t.name}' is {t.datatype}, "
                      "which a JSON answer cannot carry; ask for it with binary_data: true)")
        else:
            entry["data"] = (floats.stand_in(t.numpy()) if t.datatype in FLOAT_TYPES
                             else t.to_list())
        if params:
            entry["parameters"] = params
        head["outputs"].append(entry)
    header = floats.into(json_bytes(head))
    if not any(len(c) for c in chunks):  # no binary bytes follow (none asked, or all empty):
        return header, None  # a JSON answer, as Triton sends it (no header-length header)
    return b"".join([header, *chunks]), len(header)
