"""Consuming an engine request on the event loop without holding a thread while it waits.

:func:`open_stream` admits the request with :meth:`Engine.aopen` (the frontend's bounded work on the engine's own
admission pool) and :func:`next_chunk` awaits the next chunk through the request's output queue (woken by the
engine's put).  Engines without these (a remote engine's client) fall back to a thread.  The HTTP and WebSocket
routes both use them, so a handful of idle clients cannot exhaust asyncio's small default thread pool.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cosyvoice_fast.frontend.request import AudioChunk


async def open_stream(engine: Any, req: Any) -> Any:
    """The engine's stream for ``req``: :meth:`Engine.aopen`, or ``engine.stream`` in a thread."""
    if hasattr(engine, "aopen"):
        return await engine.aopen(req)
    return await asyncio.to_thread(engine.stream, req)


async def next_chunk(stream: Any) -> AudioChunk | None:
    """The stream's next chunk, None at its end (``async for`` of a :class:`RequestStream`; a stream without
    ``__anext__`` waits in a thread)."""
    if hasattr(stream, "__anext__"):
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
    return await asyncio.to_thread(next, stream, None)
