"""Typed state: ``BaseKey[T]`` names a value of type ``T``; a ``Store`` holds values by key.

One key class and one container behind both kinds of state a filter keeps: per request
(``CallKey``, in ``call.state``) and per runtime or process (``StateKey``, in
``FilterContext.local`` / ``FilterContext.state``). Keys are module constants and compare by
identity, so two filters that pick the same name never share a value by accident; the name is
for people (``repr``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BaseKey(Generic[T]):
    """A typed name: ``store[KEY]`` is a ``T``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Store:
    """Values by typed key."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[BaseKey[Any], Any] = {}

    def __getitem__(self, key: BaseKey[T]) -> T:
        found: T = self._items[key]
        return found

    def __setitem__(self, key: BaseKey[T], value: T) -> None:
        self._items[key] = value

    def __contains__(self, key: BaseKey[Any]) -> bool:
        return key in self._items

    def get(self, key: BaseKey[T], default: T | None = None) -> T | None:
        found: T | None = self._items.get(key, default)
        return found

    def setdefault(self, key: BaseKey[T], make: Callable[[], T]) -> T:
        """The value under ``key``, made (once) by ``make`` when there is none yet."""
        if key not in self._items:
            self._items[key] = make()
        found: T = self._items[key]
        return found

    def put(self, key: BaseKey[T], value: T) -> None:
        self._items[key] = value

    def pop(self, key: BaseKey[T]) -> T | None:
        """The value under ``key``, removed; None when there was none."""
        found: T | None = self._items.pop(key, None)
        return found
