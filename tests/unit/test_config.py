"""Bad configs fail with the key path and the reason; good ones load; check-config exits 0/1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.config.model import ConfigError, load_config, parse_config

GOOD = {
    "backends": [{"kind": "triton_grpc", "name": "triton", "url": "127.0.0.1:8001"},
                 {"kind": "onnxruntime", "name": "local", "model_dir": "/models"}],
    "models": [{"name": "clip", "backend": "triton",
                "filters": [{"limits": {"max_batch": 8, "max_in_flight": 32}}]}],
}


def with_(path: str, value: object) -> dict[str, object]:
    """GOOD with one key replaced, addressed like 'models.0.filters'."""
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return doc  # type: ignore[no-any-return]


BAD = [
    (with_("listeners.http.port", 70000), "listeners.http.port: Input should be less than"),
    (with_("listeners.http.bogus", 1), "listeners.http.bogus: Extra inputs are not permitted"),
    (with_("backends.0.kind", "tensorflow"), "backends[0]: Input tag 'tensorflow' found"),
    (with_("backends.0.timeout_s", -1), "backends[0].timeout_s: Input should be greater than 0"),
    (with_("backends.1.device", "tpu"), "backends[1].device: Input should be 'auto', 'cpu'"),
    (with_("models.0.backend", "nowhere"), "names backend 'nowhere', which is not among"),
    (with_("models.0.filters", [{"limits": {"max_batch": 0}}]),
     "models[0].filters[0].limits.max_batch: Input should be greater than 0"),
    (with_("models.0.filters", [{"limits": {"max_bach": 3}}]),
     "models[0].filters[0].limits.max_bach: Extra inputs are not permitted"),
    (with_("models.0.filters", [{"no_such_filter": {}}]),
     "models[0].filters[0]: unknown filter 'no_such_filter'"),
    (with_("models.0.filters", [{"limits": {}, "other": {}}]),
     "models[0].filters[0]: each filter is a one-key mapping"),
    (with_("defaults", {"filters": [{"limits": {"retry_after_s": "soon"}}]}),
     "defaults.filters[0].limits.retry_after_s: Input should be a valid number"),
    (with_("backends", [GOOD["backends"][0], GOOD["backends"][0]]),  # type: ignore[index]
     "backend names must be unique"),
    (with_("models.0.name", None), "models[0].name: Input should be a valid string"),
    ({**GOOD, "backends": [{"kind": "onnxruntime", "name": "local", "model_dir": "/m",
                            "models": ["a"]}], "models": [{"name": "b", "backend": "local"}]},
     "model 'b' asks backend 'local' for 'b', which is not among the models it loads ['a']"),
    ({"models": []}, "backends: Field required"),
]


@pytest.mark.parametrize(("doc", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_config_names_key_path(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    assert message in str(exc.value), str(exc.value)


def test_good_config_is_frozen() -> None:
    cfg = parse_config(GOOD)
    assert cfg.models[0].filters == ({"limits": {"max_batch": 8, "max_in_flight": 32}},)
    with pytest.raises(Exception, match="frozen"):
        cfg.models[0].name = "x"  # type: ignore[misc]


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_check_config_cli_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    (tmp_path / "models").mkdir()
    good.write_text(yaml.safe_dump(with_("backends.1.model_dir", str(tmp_path / "models"))))
    r = _check(good)
    assert r.returncode == 0 and "ok (2 backends, 1 models)" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_("models.0.filters", [{"limits": {"max_batch": -2}}])))
    r = _check(bad)
    assert r.returncode == 1
    assert "models[0].filters[0].limits.max_batch" in r.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("backends: [\n")
    r = _check(broken)
    assert r.returncode == 1 and "not valid YAML" in r.stderr
    r = _check(tmp_path / "missing.yaml")
    assert r.returncode == 1 and "cannot read" in r.stderr


def _route(name: str, *filters: dict[str, object]) -> dict[str, object]:
    return {"name": name, "backend": "triton", "filters": list(filters)}


def _with_routes(*routes: dict[str, object]) -> dict[str, object]:
    return {"backends": GOOD["backends"], "models": list(routes)}


_EXPERIMENT = {"name": "e1", "actions": [{"kind": "abort"}]}

CROSS_REFERENCES = [
    (_with_routes(_route("a", {"shape_guard": {"on_tokens": "reroute", "reroute_to": "nope"}})),
     "models[0] (a): models[0].filters[0].shape_guard.reroute_to: names route 'nope', which is "
     "not among the models ['a']"),
    (_with_routes(_route("a", {"fallback": {"degrade_to": ["a2"]}})),
     "fallback.degrade_to[0]: names route 'a2'"),
    (_with_routes(_route("a", {"shadow": {"canary": "a-canary"}})),
     "shadow.canary: names route 'a-canary'"),
    (_with_routes(_route("a", {"modality_router": {"paths": [{"route": "b"}]}})),
     "modality_router.paths[0].route: names route 'b'"),
    (_with_routes(_route("a", {"fault": {"experiments": [_EXPERIMENT]}}),
                  _route("b", {"fault": {"experiments": [_EXPERIMENT]}})),
     "models[1] (b): models[1].filters[0].fault: experiment 'e1' is also defined at models[0] "
     "(a): models[0].filters[0].fault; experiment names are process-wide and must be unique"),
    ({"backends": GOOD["backends"], "models": [{"name": "a", "backend": "triton"},
                                               {"name": "b", "backend": "triton"}],
      "defaults": {"filters": [{"fault": {"experiments": [_EXPERIMENT]}}]}},
     "models[1] (b): defaults.filters[0].fault: experiment 'e1' is also defined at models[0]"),
]


@pytest.mark.parametrize(("doc", "message"), CROSS_REFERENCES,
                         ids=["reroute_to", "degrade_to", "shadow.canary", "router path",
                              "experiment twice", "experiment in defaults"])
def test_what_filters_name_must_exist(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    assert message in str(exc.value), str(exc.value)


def test_routes_that_exist_are_accepted() -> None:
    cfg = parse_config(_with_routes(
        _route("a", {"fallback": {"degrade_to": ["b"]}}, {"shadow": {"canary": "b"}},
               {"fault": {"experiments": [_EXPERIMENT]}}),
        _route("b", {"shape_guard": {"on_tokens": "reroute", "reroute_to": "a"}})))
    assert [m.name for m in cfg.models] == ["a", "b"]


def _write(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "mmguard.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_files_a_config_names_must_exist_where_it_serves(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.onnx").write_bytes(b"x")
    doc = {"backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": str(repo),
                         "models": ["m", "mm"]},
                        {"kind": "onnxruntime", "name": "typo",
                         "model_dir": str(tmp_path / "rep")}],
           "models": [{"name": "m", "backend": "ort", "filters": [{"shape_guard": {"inputs": {
               "TEXT": {"tokenizer": str(tmp_path / "tokenizer.json"), "max_tokens": 77}}}}]}]}
    path = _write(tmp_path, doc)
    load_config(path)  # the document alone is valid: a config may be checked elsewhere
    with pytest.raises(ConfigError) as exc:
        load_config(path, check_files=True)
    problems = exc.value.problems
    assert f"backends[0] (ort).models: no model file for ['mm'] in {repo}" in problems[0]
    assert problems[1] == f"backends[1] (typo).model_dir: {tmp_path / 'rep'} is not a directory"
    assert problems[2] == (f"models[0] (m): models[0].filters[0].shape_guard.inputs.TEXT."
                           f"tokenizer: {tmp_path / 'tokenizer.json'}: No such file or directory")
    r = _check(path)
    assert r.returncode == 1 and "(typo).model_dir" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("content", "message"), [
    (b"backends: []\nmodels: []\nname: caf\xe9\n",
     "not UTF-8 text: byte 0xe9 at line 3 (offset 33); save the file as UTF-8"),
    (b"backends: []\nmodels: []\nshutdown_grace_s: " + b"9" * 5000 + b"\n",
     "a number has 5000 digits; numbers in a config have at most 4300 digits"),
])
def test_unreadable_files_give_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.problems == [message]
    r = _check(path)
    assert r.returncode == 1 and r.stderr == f"{path} is invalid:\n  {message}\n"


def test_canary_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("  s3cret\n")
    cfg = parse_config(with_("canary", {"share": 0.1, "secret_file": str(secret)}))
    assert cfg.canary.resolve_secret() == "s3cret"
    monkeypatch.setenv("MMGUARD_TEST_SECRET", "from-env")
    assert parse_config(with_("canary", {"secret_env": "MMGUARD_TEST_SECRET"})
                        ).canary.resolve_secret() == "from-env"
    for canary, message in [
            ({"secret_file": str(tmp_path / "none")}, "canary: Value error, secret_file: cannot "
                                                      "read"),
            ({"secret_env": "MMGUARD_TEST_UNSET"}, "secret_env: environment variable "
                                                   "MMGUARD_TEST_UNSET is empty or unset: share "
                                                   "membership would be computable by clients"),
            ({"secret_env": "X", "secret_file": str(secret)}, "comes from one source")]:
        with pytest.raises(ConfigError) as exc:
            parse_config(with_("canary", canary))
        assert message in str(exc.value)
        assert "s3cret" not in str(exc.value)
