"""Fixtures of the adversarial tier: one real ``mmguard serve`` process per module, on the ORT
identity models (``identity_fp32`` answers the probes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ort_config
from tests.support.adversary import serve
from tests.support.process import MmguardProcess


@pytest.fixture(scope="module")
def served(ort_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MmguardProcess]:
    """A served mmguard with the default listeners, for attacks that need no special config."""
    with serve(tmp_path_factory.mktemp("adversary"), ort_config(ort_models)) as proc:
        yield proc
