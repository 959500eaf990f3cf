"""Bad configs fail with the key path and the reason; good ones load; check-config exits 0/1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.config import ConfigError, parse_config

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
    good.write_text(yaml.safe_dump(GOOD))
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
