"""One mmguard on ONNX Runtime for every fuzz test that goes over sockets (see ``fronts.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ort_config
from tests.fuzz.fronts import Client
from tests.support.mmguard import RunningMmguard


@pytest.fixture(scope="session")
def fuzz_client(ort_models: Path) -> Iterator[Client]:
    with RunningMmguard(ort_config(ort_models)) as proxy:
        proxy.wait_ready()
        client = Client(proxy)
        try:
            yield client
        finally:
            client.close()
