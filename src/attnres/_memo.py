"""One cache discipline (issue 33): a memo belongs to one registry generation.

What attnres derives from the registry (a resolution, a layer's bound kernel,
a varlen adapter, a measurement) is kept in a :class:`GenerationMemo`: a dict
that reads empty after any registry change -- a backend or kernel registered,
replaced or removed, a plugin loaded (:func:`attnres.backends.registry_generation`
counts them). No module subscribes to changes to clear its caches: each memo
compares the generation it was filled under with the current one when it is
read. :meth:`GenerationMemo.put` also refuses a value computed against an older
registry (the generation read before computing it).

A memo derived from another memo's entries (the layer memo of
:mod:`attnres.modules` holds the resolution cache's entries) reads that memo's
:attr:`GenerationMemo.epoch`: it counts every time an entry may have left
(cleared, evicted, replaced, a new generation), so the derived memo keys on it
rather than being cleared by anyone.

The memo is not a lock: callers that read-then-write under threads keep their
own lock around it, as they would around a dict.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import ClassVar, Generic, TypeVar

from attnres import backends

__all__ = ["GenerationMemo"]

K = TypeVar("K")
V = TypeVar("V")


class GenerationMemo(Generic[K, V]):
    """A dict of what was derived under the current registry generation.

    ``maxsize``: at most that many entries; a :meth:`put` into a full memo
    drops the oldest eighth first (``None``: unbounded).
    """

    __slots__ = ("_data", "_generation", "epoch", "maxsize")
    _registry: ClassVar[backends._Registry] = backends._REGISTRY

    def __init__(self, maxsize: int | None = None) -> None:
        self._data: dict[K, V] = {}
        self._generation = self._registry.generation
        self.maxsize = maxsize
        #: counts the times an entry may have left (see the module's docstring)
        self.epoch = 0

    def current(self) -> dict[K, V]:
        """The entries of the current generation (a new, empty dict after a change)."""
        generation = self._registry.generation
        if generation != self._generation:
            self._data = {}
            self._generation = generation
            self.epoch += 1
        return self._data

    def put(self, key: K, value: V, generation: int | None = None) -> None:
        """Keep ``value``, unless ``generation`` (read before computing it) is
        older than the registry's now: it may answer for a registry that is gone."""
        data = self._data if self._generation == self._registry.generation else self.current()
        if generation is not None and generation != self._generation:
            return
        if key in data:
            self.epoch += 1  # a value replaced
        elif self.maxsize is not None and len(data) >= self.maxsize:
            for old in list(data)[: max(1, self.maxsize // 8)]:
                data.pop(old, None)
            self.epoch += 1
        data[key] = value

    def get(self, key: K, default: V | None = None) -> V | None:
        if self._generation == self._registry.generation:  # the hit path: one compare
            return self._data.get(key, default)
        return self.current().get(key, default)

    def pop(self, key: K, default: V | None = None) -> V | None:
        self.epoch += 1
        return self.current().pop(key, default)

    def setdefault(self, key: K, value: V) -> V:
        return self.current().setdefault(key, value)

    def clear(self) -> None:
        self._data = {}
        self.epoch += 1

    def keys(self) -> KeysView[K]:
        return self.current().keys()

    def values(self) -> ValuesView[V]:
        return self.current().values()

    def items(self) -> ItemsView[K, V]:
        return self.current().items()

    def __getitem__(self, key: K) -> V:
        return self.current()[key]

    def __setitem__(self, key: K, value: V) -> None:
        self.put(key, value)

    def __delitem__(self, key: K) -> None:
        self.epoch += 1
        del self.current()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.current()

    def __len__(self) -> int:
        return len(self.current())

    def __iter__(self) -> Iterator[K]:
        return iter(self.current())

    def __bool__(self) -> bool:
        return bool(self.current())
