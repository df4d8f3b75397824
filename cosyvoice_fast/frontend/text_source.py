"""Where streamed text comes from: an iterator, an async iterator or a queue of text pieces, read with limits.

A bi-streaming request lives as long as its text source.  A client that never sends the end (a stuck upstream
LLM, a forgotten WebSocket) must not hold a slot forever, so every source is read under two limits: the longest
wait for the next piece (``idle_timeout_s``) and the longest whole stream (``total_timeout_s``).  Exceeding
either raises :class:`TextSourceTimeout` with a message that says which and what to do.

Queues end with ``None`` (or :data:`END`); iterators end by being exhausted.  A blocking plain iterator can only
be checked between pieces (Python cannot interrupt ``next``); queues and async sources are cut while waiting.
Pieces are yielded as they come (``str``, possibly empty): :class:`~.text_stream.IncrementalText` turns them
into token ids.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Union

END = None  # what a producer puts on a queue to end the text

TextSource = Union[Iterable[str], "queue.Queue[str | None]"]
AsyncTextSource = Union[AsyncIterable[str], "asyncio.Queue[str | None]"]


class TextSourceTimeout(TimeoutError):
    """The text source went quiet for too long, or the stream as a whole ran too long."""


@dataclass(frozen=True, slots=True)
class SourceLimits:
    """How long a text source may take: between two pieces, and from the first read to the end."""

    idle_timeout_s: float = 30.0
    total_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SourceLimits.{name}={value!r}: use a number of seconds > 0")


class _Deadlines:
    """The two limits against a clock; ``wait()`` is how long the next read may block."""

    def __init__(self, limits: SourceLimits, clock: Callable[[], float]):
        self.limits, self.clock = limits, clock
        self.start = self.last = clock()

    def wait(self) -> float:
        now = self.clock()
        return max(0.0, min(self.last + self.limits.idle_timeout_s, self.start + self.limits.total_timeout_s) - now)

    def check(self) -> None:
        """Raise if a limit has passed; else note a piece arrived now."""
        now = self.clock()
        if now - self.start > self.limits.total_timeout_s:
            raise TextSourceTimeout(
                f"the text stream ran longer than {self.limits.total_timeout_s:g} s without ending; end it (send "
                "'end' / put None / stop the iterator) and send longer texts as several requests")
        if now - self.last > self.limits.idle_timeout_s:
            raise TextSourceTimeout(
                f"no text piece arrived for {self.limits.idle_timeout_s:g} s; send the next piece sooner or end "
                "the stream when the text is complete")
        self.last = now


def _piece(item: object) -> str:
    """A piece as the source gave it: ``str``, or a list/tuple of token ids (pre-tokenised sources)."""
    if not isinstance(item, (str, list, tuple)):
        raise TypeError(f"a text source must give str pieces, got {type(item).__name__}")
    return item  # type: ignore[return-value]


def read_pieces(source: TextSource, limits: SourceLimits = SourceLimits(),
                clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """The pieces of a synchronous source (an iterable of str, or a ``queue.Queue`` ended by ``None``)."""
    deadlines = _Deadlines(limits, clock)
    if isinstance(source, queue.Queue):
        while True:
            try:
                item = source.get(timeout=deadlines.wait())
            except queue.Empty:
                item = queue.Empty
            deadlines.check()
            if item is queue.Empty:  # the wait ended at a limit; check() above raised unless the clock lags
                continue
            if item is END:
                return
            yield _piece(item)
    for item in source:
        deadlines.check()
        yield _piece(item)


async def aread_pieces(source: AsyncTextSource, limits: SourceLimits = SourceLimits(),
                       clock: Callable[[], float] = time.monotonic) -> AsyncIterator[str]:
    """The pieces of an asynchronous source (an async iterable of str, or an ``asyncio.Queue`` ended by
    ``None``); a wait past a limit is cancelled and raises :class:`TextSourceTimeout`."""
    deadlines = _Deadlines(limits, clock)
    if isinstance(source, asyncio.Queue):
        get: Callable[[], object] = source.get
    else:
        it = source.__aiter__()
        get = it.__anext__
    while True:
        try:
            item = await asyncio.wait_for(get(), timeout=deadlines.wait())  # type: ignore[arg-type]
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            deadlines.check()
            raise TextSourceTimeout("the text source timed out") from None  # only if the clock lags the loop
        deadlines.check()
        if item is END:
            return
        yield _piece(item)
