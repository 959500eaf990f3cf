"""Files a config names are read bounded (issue 26 item 2): a regular file under a size cap,
refused with the reason otherwise — for secrets, TLS files and the config file alike."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from proxy.config.model import ConfigError, load_config
from proxy.files import SECRET_BYTES, read_bounded, regular_file_problem


def test_a_small_regular_file_is_read_whole(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_bytes(b"s3cret\n")
    assert read_bounded(f, 100) == b"s3cret\n"
    assert regular_file_problem(f, 100) is None


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"),
                                            ("/dev/null", "a character device")])
def test_a_device_is_refused_before_a_byte_is_read(path: str, kind: str) -> None:
    with pytest.raises(ValueError, match=f"{path} is {kind}; a regular file is expected"):
        read_bounded(path, 1 << 20)
    assert regular_file_problem(Path(path)) == f"{path} is {kind}; a regular file is expected"


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[str] = []
    t = threading.Thread(target=lambda: outcome.append(_refusal(fifo)), daemon=True)
    t.start()
    t.join(10)  # a blocking open would never return
    assert outcome == [f"{fifo} is a FIFO (named pipe); a regular file is expected"]


def test_a_directory_and_a_big_file_are_refused_naming_the_limit(tmp_path: Path) -> None:
    assert _refusal(tmp_path) == f"{tmp_path} is a directory; a regular file is expected"
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(SECRET_BYTES + 1)  # sparse: costs no disk
    assert _refusal(big, SECRET_BYTES) == (f"{big} is {SECRET_BYTES + 1} bytes; at most "
                                           f"{SECRET_BYTES} bytes are read from it")


def _refusal(path: Path, limit: int = 1 << 20) -> str:
    try:
        read_bounded(path, limit)
    except ValueError as exc:
        return str(exc)
    return "read"


def _config(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("key", ["canary.secret_file", "listeners.admin.token_file",
                                 "listeners.http.tls.cert_file",
                                 "listeners.http.tls.client_ca_file"])
def test_every_file_key_refuses_dev_zero_with_the_reason(tmp_path: Path, key: str) -> None:
    section, *rest = key.split(".")
    doc: dict[str, object] = {}
    node: dict[str, object] = doc
    for part in [section, *rest[:-1]]:
        node = node.setdefault(part, {})  # type: ignore[assignment]
    if "tls" in key:
        node.update({"cert_file": "/dev/zero", "key_file": "/dev/zero"})
    node[rest[-1]] = "/dev/zero"
    with pytest.raises(ConfigError) as exc:
        load_config(_config(tmp_path, doc))
    text = str(exc.value)
    assert "/dev/zero is a character device; a regular file is expected" in text, text


def test_the_config_file_itself_must_be_a_regular_file() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config("/dev/zero")
    assert "/dev/zero is a character device; a regular file is expected" in str(exc.value)
