"""The config checks that look past one model: what filters name (routes, files, process-wide
names), model directories on this machine, secrets read from files or the environment, and the
one-line messages for a file that cannot be read at all.

``proxy.config.model`` runs them when a config loads, so ``mmguard check-config`` refuses everything
``mmguard serve`` (or a reload) would fail on, each problem as one line naming the key.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

from pydantic import SecretStr

from proxy.files import SECRET_BYTES, read_bounded
from proxy.lifecycle import ConfigReferences
from proxy.telemetry.logs import register_secret

_OFFLINE: ContextVar[list[str] | None] = ContextVar("mmguard_config_offline", default=None)


@contextlib.contextmanager
def offline() -> Iterator[list[str]]:
    """Validation inside checks everything but what exists only where mmguard runs (secrets
    from files or the environment, TLS files): ``mmguard check-config --offline``, in CI, on
    the shipped ConfigMaps as they are. Yields the list of what was not checked."""
    skipped: list[str] = []
    token = _OFFLINE.set(skipped)
    try:
        yield skipped
    finally:
        _OFFLINE.reset(token)


def skipped_offline(what: str) -> bool:
    """True (and ``what`` noted as not checked) when validating offline."""
    found = _OFFLINE.get()
    if found is None:
        return False
    if what not in found:
        found.append(what)
    return True


def reference_problems(routes: set[str],
                       found: Iterable[tuple[str, ConfigReferences]]) -> list[str]:
    """Routes named that are not routes; process-wide names given twice."""
    problems: list[str] = []
    owners: dict[tuple[str, str], str] = {}
    for where, refs in found:
        for option, name in refs.routes:
            if name not in routes:
                problems.append(f"{where}.{option}: names route '{name}', which is not among "
                                f"the models {sorted(routes)}")
        for kind, name in refs.unique_names:
            first = owners.setdefault((kind, name), where)
            if first != where:
                problems.append(f"{where}: {kind} '{name}' is also defined at {first}; "
                                f"{kind} names are process-wide and must be unique")
    return problems


def model_dir_problems(where: str, model_dir: Path, models: tuple[str, ...] | None) -> list[str]:
    """An ONNX Runtime repository that is not there, or lacks a model the config lists."""
    if not model_dir.is_dir():
        return [f"{where}.model_dir: {model_dir} is not a directory"]
    found = find_models(model_dir)
    missing = [m for m in models or () if m not in found]
    if not missing:
        return []
    return [f"{where}.models: no model file for {missing} in {model_dir} (found: "
            f"{sorted(found)[:10]}; expected <model>/<version>/model.onnx or <model>.onnx)"]


def read_secret(name: str, inline: SecretStr | None, file: Path | None, env: str | None,
                why_not_empty: str) -> str | None:
    """A secret from whichever of its sources (``<name>``, ``<name>_file``, ``<name>_env``) is
    set, read now; None when none is. ValueError naming the source when it is missing or empty;
    the message never contains the secret."""
    if inline is None and (file is not None or env is not None) and skipped_offline(
            f"{name}_file {file}" if file is not None else f"{name}_env {env}"):
        return "(not read offline)"
    if inline is not None:
        secret, where = inline.get_secret_value(), name
    elif file is not None:
        try:
            secret = read_bounded(file, SECRET_BYTES).decode().strip()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}_file: {file} is not UTF-8 text: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{name}_file: {exc}") from None
        where = f"{name}_file {file}"
    elif env is not None:
        secret = os.environ.get(env, "").strip()
        where = f"{name}_env: environment variable {env}"
    else:
        return None
    if not secret:
        raise ValueError(f"{where} is empty or unset: {why_not_empty}")
    register_secret(secret)  # whatever logs it later, the log shows <redacted>
    return secret


def unreadable_value(exc: ValueError) -> str:
    """One line for a value YAML could not construct (an integer past Python's digit limit)."""
    digits = re.search(r"value has (\d+) digits", str(exc))
    if digits is None:
        return f"a value cannot be read: {str(exc).splitlines()[0]}"
    return (f"a number has {digits[1]} digits; numbers in a config have at most "
            f"{sys.get_int_max_str_digits()} digits")


def find_models(model_dir: Path) -> dict[str, tuple[str, Path]]:
    """name → (version, file): <name>/<highest numeric version>/model.onnx, or <name>.onnx."""
    found: dict[str, tuple[str, Path]] = {}
    if not model_dir.is_dir():
        return found
    for entry in sorted(model_dir.iterdir()):
        if entry.is_file() and entry.suffix == ".onnx":
            found[entry.stem] = ("1", entry)
        elif entry.is_dir():
            versions = sorted((int(v.name), v / "model.onnx") for v in entry.iterdir()
                              if v.name.isdigit() and (v / "model.onnx").is_file())
            if versions:
                found[entry.name] = (str(versions[-1][0]), versions[-1][1])
    return found
