"""A fixed set of request slots, each owning state that is expensive to make (a KV cache and its CUDA graphs).

Graph-captured decoding bakes buffer addresses into the graph, so caches cannot be allocated per request: they
are allocated once, and a request borrows one for its lifetime.  This module is only the bookkeeping (which
slot is free, who holds which), kept free of CUDA so it can be tested anywhere; so is :class:`StepRounds`, the
bookkeeping of batched decoding (which slots take part in a batched step, where each one's result waits).
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


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


class StepRounds(Generic[R]):
    """Rounds of batched decode steps over slots, driven by per-request iterators that each want one token.

    A slot whose next input is known (its previous token was produced and handed out) is *submitted*; it
    then waits.  When some slot asks for its token (:meth:`take`) and none is buffered for it, ONE batched
    ``step`` runs over every waiting slot, and each one's result is buffered until its own consumer asks.  So
    consumers driven round-robin (the engine calls ``next`` on every active request once per turn) share one
    step per turn instead of one each.  A slot never has more than one result buffered: it is submitted again
    only after its consumer took the last one, so a slow consumer is never stepped ahead.

    ``step(batch)`` gets ``[(index, row), ...]`` sorted by slot index and returns one token per entry (or
    raises: then every row of that batch gets the error from its own :meth:`take`).  Not thread-safe on its
    own: the caller serialises calls (the backend's lock), which also serialises the steps.  ``row`` objects
    are opaque; identity tells a request from a later one that reuses its slot.
    """

    def __init__(self, step: Callable[[list[tuple[int, R]]], Sequence[int]]):
        self._step = step
        self._waiting: dict[int, R] = {}
        self._ready: dict[int, tuple[R, int | BaseException]] = {}
        self.steps = 0  # batched steps run
        self.rows_stepped = 0  # sum of their batch sizes

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, index: int, row: R) -> None:
        """Slot ``index`` (held by ``row``) has its next input ready: include it in the next step."""
        held = self._ready.get(index)
        if held is not None:
            if held[0] is row:
                raise ValueError(f"slot {index} submitted again before its last result was taken")
            del self._ready[index]  # a result left by an earlier holder of the slot that closed mid-round
        self._waiting[index] = row

    def take(self, index: int, row: R) -> int:
        """The token of ``row``'s submitted step: buffered, or computed now in a step over every waiting slot."""
        held = self._ready.get(index)
        if held is None or held[0] is not row:
            if self._waiting.get(index) is not row:
                raise ValueError(f"slot {index} asked for a token it never submitted")
            self._run()
            held = self._ready[index]
        del self._ready[index]
        result = held[1]
        if isinstance(result, BaseException):
            raise result
        return result

    def withdraw(self, index: int, row: R) -> None:
        """``row`` is finished or closed: never step it again and drop its buffered result (idempotent)."""
        if self._waiting.get(index) is row:
            del self._waiting[index]
        held = self._ready.get(index)
        if held is not None and held[0] is row:
            del self._ready[index]

    def _run(self) -> None:
        batch = sorted(self._waiting.items(), key=lambda kv: kv[0])
        self._waiting.clear()
        self.steps += 1
        self.rows_stepped += len(batch)
        try:
            tokens = list(self._step(batch))
            if len(tokens) != len(batch):
                raise RuntimeError(f"a batched step returned {len(tokens)} tokens for {len(batch)} rows")
        except Exception as e:  # noqa: BLE001 - handed to every row of the failed step
            tokens = [e] * len(batch)
        for (index, row), tok in zip(batch, tokens):
            self._ready[index] = (row, tok)
