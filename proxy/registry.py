"""Filters by name: every factory registered under the ``mmguard.filters`` entry-point group.

The entry point's name is the filter's name, written once (``pyproject.toml``); the factory's
``name`` must match it. A filter added to ``pyproject.toml`` is found only once the package is
installed again (``pip install -e .``): entry points are read from the installed metadata.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points

from proxy.chain import FilterFactory


class FilterNameMismatch(RuntimeError):
    """A factory whose ``name`` differs from its entry point's: its decisions, state and admin
    routes would be filed under a name the config does not use."""


@cache
def filter_factories() -> dict[str, FilterFactory]:
    """Name → factory of every installed filter (loaded once per process)."""
    found: dict[str, FilterFactory] = {}
    for ep in entry_points(group="mmguard.filters"):
        loaded = ep.load()
        factory: FilterFactory = loaded() if isinstance(loaded, type) else loaded
        if getattr(factory, "name", ep.name) != ep.name:
            raise FilterNameMismatch(f"entry point '{ep.name}' ({ep.value}) names a factory "
                                     f"whose name is '{factory.name}'; the entry point is the "
                                     "filter's name: make them the same")
        found[ep.name] = factory
    return found
