"""Configuration documents for the fuzzers: anything JSON/YAML can hold, and a complete valid
config (every backend kind, every filter with options) with one part replaced, removed or added.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from proxy.registry import filter_factories
from tests.fuzz.mutations import json_scalars, json_values


def valid_doc() -> dict[str, Any]:
    return {
        "listeners": {"http": {"port": 0, "max_request_bytes": 1024},
                      "grpc": {"port": 0}, "admin": {"port": 0, "token": "t"}},
        "backends": [
            {"kind": "triton_grpc", "name": "tg", "url": "127.0.0.1:8001", "channels": 2},
            {"kind": "triton_http", "name": "th", "url": "http://127.0.0.1:8000"},
            {"kind": "onnxruntime", "name": "ort", "model_dir": "/nonexistent/models",
             "max_batch_size": {"m": 8}},
            {"kind": "vllm", "name": "v", "url": "http://127.0.0.1:8002", "image_input": "no"},
        ],
        "models": [
            {"name": "a", "backend": "tg", "filters": [{"limits": {"max_batch": 4}}]},
            {"name": "b", "backend": "th", "backend_model": "a", "timeout_s": 2.5},
            {"name": "c", "backend": "v", "filters": []},
        ],
        "defaults": {"filters": [{"limits": {}}]},
        "telemetry": {"log_level": "info"},
        "openai": {"image_url_allow_hosts": ["images.example.com"]},
        "contract_refresh_s": 5,
    }


@st.composite
def filter_entries(draw: st.DrawFn) -> Any:
    """``{<filter>: {options}}`` with options named as the filter's config model names them."""
    factories = filter_factories()
    name = draw(st.sampled_from(sorted(factories)) | st.text(max_size=6))
    model = factories[name].config_model if name in factories else None
    keys = sorted(model.model_fields) if model is not None else []
    options = draw(st.dictionaries(st.sampled_from(keys) if keys else st.text(max_size=6),
                                   json_values(6), max_size=4)
                   | json_scalars())
    entry: Any = {name: options}
    if draw(st.integers(0, 9)) == 0:
        entry = draw(st.sampled_from([{}, {name: options, "limits": {}}, [entry], name]))
    return entry


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(_paths(v, (*prefix, i)))
    return out


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    doc: Any = valid_doc()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        way = draw(st.sampled_from(["replace", "remove", "add_key", "filters"]))
        if not path:
            if way == "replace":
                doc = draw(json_values())
            continue
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if way == "replace":
            parent[last] = draw(json_values())
        elif way == "remove":
            del parent[last]
        elif way == "add_key" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_values(4))
        elif way == "filters" and isinstance(doc, dict):
            models = doc.get("models")
            if isinstance(models, list) and models and isinstance(models[0], dict):
                models[0]["filters"] = draw(st.lists(filter_entries(), max_size=3))
    return doc


def config_docs() -> st.SearchStrategy[Any]:
    return st.one_of(json_values(), mutated_docs(),
                     st.lists(filter_entries(), max_size=3).map(
                         lambda fs: {**valid_doc(), "defaults": {"filters": fs}}))
