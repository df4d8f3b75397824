"""A fixed set of request slots, each owning state that is expensive to make (a KV cache and its CUDA graphs).

Graph-captured decoding bakes buffer addresses into the graph, so caches cannot be allocated per request: they
are allocated once, and a request borrows one for its lifetime.  This module is only the bookkeeping (which
slot is free, who holds which), kept free of CUDA so it can be tested anywhere.  The engine sizes its admission
from :attr:`SlotPool.capacity`, so :class:`PoolExhausted` is a guard against a scheduler bug, never a
request's fate.
"""

from __future__ import annotations

import threading
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class PoolExhausted(RuntimeError):
    """Every slot is held by a running request; the message says how many there are and what to do."""


class SlotPool(Generic[T]):
    """Hands out the lowest free slot index with its item; thread-safe; releasing twice is a bug and raises.

    Lowest-first keeps the choice deterministic (tests, profiles) and reuses the same few slots under light load.
    """

    def __init__(self, items: Sequence[T], name: str = "slot"):
        if not items:
            raise ValueError(f"a {name} pool needs at least one slot")
        self._items = list(items)
        self._free = set(range(len(self._items)))
        self._lock = threading.Lock()
        self.name = name

    @property
    def capacity(self) -> int:
        return len(self._items)

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._items) - len(self._free)

    def item(self, index: int) -> T:
        return self._items[index]

    def acquire(self) -> tuple[int, T]:
        """Take a free slot: ``(index, item)``.  Raises :class:`PoolExhausted` when none is free."""
        with self._lock:
            if not self._free:
                raise PoolExhausted(
                    f"all {len(self._items)} {self.name}s are in use by running requests; wait for one to finish, "
                    f"lower the concurrency, or build the backend with more slots")
            index = min(self._free)
            self._free.remove(index)
        return index, self._items[index]

    def release(self, index: int) -> None:
        """Give slot ``index`` back; raises ``ValueError`` if it is not currently held."""
        with self._lock:
            if not 0 <= index < len(self._items) or index in self._free:
                raise ValueError(f"{self.name} {index} is not in use (released twice?)")
            self._free.add(index)
