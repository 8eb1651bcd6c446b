"""A name-keyed registry (pure): what :mod:`tag.parallel.strategy` keeps its strategies in,
:mod:`tag.parallel.pipeline` its pipeline schedules, :mod:`tag.sim.strategies` its group costings
and :mod:`tag.executor.strategies` its executions (the last two keyed by a strategy's name), so
that a new one drops in by registration."""

from __future__ import annotations

from typing import Generic, TypeVar

from ..errors import PlanError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind by name (their ``name`` attribute, or the key given at registration),
    in registration order.

    Args:
        kind: what an entry is, for the error of a nameless one (``"strategy"``).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, item: T, name: str | None = None) -> T:
        """Make ``item`` available under ``name`` (default: ``item.name``), replacing one of that
        name."""
        key = item.name if name is None else name
        if not key:
            raise ValueError(f"a {self.kind} needs a name")
        self._items[key] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove the entry registered under ``name`` (no error if there is none)."""
        self._items.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        return tuple(self._items)

    def values(self) -> list[T]:
        """Registered entries, in registration order."""
        return list(self._items.values())

    def find(self, name: str) -> T | None:
        """The entry registered under ``name``, or None."""
        return self._items.get(name)

    def get(self, name: str, *, where: str) -> T:
        """The entry registered under ``name``; :class:`PlanError` naming ``where`` otherwise."""
        s = self._items.get(name)
        if s is None:
            raise PlanError(f"{where}: expected one of {list(self._items)}, got {name!r}")
        return s
