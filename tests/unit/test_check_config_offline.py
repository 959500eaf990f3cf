"""``mmguard check-config --offline``: everything but what exists only where mmguard runs
(secret files and variables, TLS files, model directories) is checked, and what was not is
named; a real mistake still fails offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.cli.main import main as cli_main

POD_ONLY = {
    "listeners": {"http": {"tls": {"cert_file": "/pod/tls/tls.crt",
                                   "key_file": "/pod/tls/tls.key"}},
                  "admin": {"token_env": "MMGUARD_TEST_UNSET_TOKEN"}},
    "canary": {"secret_file": "/pod/canary/secret"},
    "backends": [{"kind": "onnxruntime", "name": "ort", "model_dir": "/pod/models"}],
    "models": [{"name": "m", "backend": "ort"}],
}


def test_offline_checks_all_but_the_pod_files_and_names_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "mmguard.yaml"
    file.write_text(yaml.safe_dump(POD_ONLY))
    assert cli_main(["check-config", "--offline", str(file)]) == 0
    out = capsys.readouterr().out
    for name in ("TLS file /pod/tls/tls.crt", "token_env MMGUARD_TEST_UNSET_TOKEN",
                 "secret_file /pod/canary/secret", "ort.model_dir /pod/models"):
        assert name in out, out
    assert cli_main(["check-config", str(file)]) == 1  # on this machine they are missing


def test_offline_still_refuses_a_real_mistake(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = {**POD_ONLY, "models": [{"name": "m", "backend": "nope"}]}
    file = tmp_path / "mmguard.yaml"
    file.write_text(yaml.safe_dump(bad))
    assert cli_main(["check-config", "--offline", str(file)]) == 1
    assert "nope" in capsys.readouterr().err
