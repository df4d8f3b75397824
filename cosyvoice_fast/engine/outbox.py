"""A request's output queue that an asyncio consumer can await without a thread.

The engine's workers ``put`` chunks from their own threads; a thread-based consumer ``get``s as with any
``queue.Queue``.  An asyncio consumer calls :meth:`Outbox.aget`: when the queue is empty it parks a future and the
next ``put`` resolves it through ``loop.call_soon_threadsafe``.  So a stream waiting for its next chunk (or a text
stream waiting for a slow client) holds no thread of asyncio's small default pool: a handful of idle clients can no
longer starve every other request of those threads.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any, Callable


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Outbox(queue.Queue):
    """``queue.Queue`` plus :meth:`aget` (one asyncio waiter at a time: a request has one consumer)."""

    def __init__(self) -> None:
        super().__init__()
        self._waker: Callable[[], None] | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        waker = self._waker
        if waker is not None:
            try:
                waker()
            except RuntimeError:  # the consumer's event loop is closed: nobody is waiting any more
                pass

    async def aget(self) -> Any:
        """The next item, awaited on the running loop (no thread is held while the queue is empty)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self.get_nowait()
            except queue.Empty:
                pass
            fut = loop.create_future()
            self._waker = lambda: loop.call_soon_threadsafe(_resolve, fut)
            try:
                try:  # a put between the first look and setting the waker would otherwise be missed
                    return self.get_nowait()
                except queue.Empty:
                    pass
                await fut
            finally:
                self._waker = None
