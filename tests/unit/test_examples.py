"""Every shipped example config passes check-config."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config.model import load_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.models
