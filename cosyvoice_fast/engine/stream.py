"""The consumer side of one request (:class:`RequestStream`): what ``Engine.stream`` hands back.

Kept apart from the scheduler: it only reads the request's output queue, marks the request cancelled and tells
the engine's observers how the request ended.  ``engine`` is duck-typed (its ``_cv`` condition and ``_notify``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.frontend.text_normalize import EmptyTextError, TextTooLongError
from cosyvoice_fast.frontend.text_source import TextSourceTimeout
from cosyvoice_fast.telemetry.record import RequestTelemetry, now
from cosyvoice_fast.engine.state import RequestState

#: the end-of-stream marker a request's output queue receives last
DONE = object()
#: failures that are the client's doing (its text, or its text source's pace): outcome ``rejected``, logged as one
#: line by the request log, never with a traceback
CLIENT_ERRORS = (EmptyTextError, TextTooLongError, TextSourceTimeout)


class RequestStream:
    """The consumer side of one request: iterate for :class:`AudioChunk`s.

    ``close()`` (also on ``with`` exit and when the object is garbage-collected, even before the first chunk)
    cancels the request if it is still running.  Unlike a generator it may be closed from another thread while a
    ``next`` is blocked waiting: that ``next`` then ends the iteration.  ``async for`` iterates the same chunks on an
    event loop without a thread per waiting stream (:meth:`__anext__`).
    """

    def __init__(self, engine: Any, state: RequestState):
        self._engine = engine
        self._state = state
        self._got_last = False
        self._ended = False
        self._lock = threading.Lock()

    @property
    def request_id(self) -> str:
        return self._state.id

    @property
    def telemetry(self) -> RequestTelemetry:
        """The request's live record (front ends set ``app_queue_s`` on it and draw it while it streams)."""
        return self._state.telemetry

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> AudioChunk:
        if self._ended:
            raise StopIteration
        chunk = self._take(self._state.out.get())
        if chunk is None:
            raise StopIteration
        return chunk

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> AudioChunk:
        """The next chunk, awaited without holding a thread (the output queue wakes this loop when the engine
        puts a chunk); ``StopAsyncIteration`` at the end.  Cancelling the awaiting task leaves the request
        running: call :meth:`close` to cancel it."""
        if self._ended:
            raise StopAsyncIteration
        out = self._state.out
        item = await out.aget() if hasattr(out, "aget") else await asyncio.to_thread(out.get)
        chunk = self._take(item)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    def _take(self, item: object) -> AudioChunk | None:
        """One item of the output queue -> the chunk to hand out (None at the end; raises a request's error)."""
        if self._ended:
            return None
        if item is DONE:
            self._end("ok" if self._got_last else "cancelled")
            return None
        if isinstance(item, BaseException):
            self._end("rejected" if isinstance(item, CLIENT_ERRORS) else "error")
            raise item
        item.timing.delivered = now()
        if item.is_last:
            self._got_last = True
            self._state.telemetry.finished = item.timing.delivered
            item.telemetry = self._state.telemetry
        return item

    def close(self) -> None:
        self._end("ok" if self._got_last else "cancelled")

    def fail(self, error: str) -> None:
        """End the request as failed by its consumer (e.g. the audio could not be encoded): observers count it
        ``error`` with ``error`` as the reason, not ``ok``."""
        if not self._ended and self._state.telemetry.error is None:
            self._state.telemetry.error = error
        self._end("error")

    def _end(self, outcome: str) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        st = self._state
        if not st.done:
            st.cancelled.set()
            with self._engine._cv:
                self._engine._cv.notify_all()
        self._engine._notify(st.telemetry, outcome)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
