"""Honest figures for the app's own runs: how long an event waited in Gradio's queue (the ``app_queue`` TTFB stage)
and the engine's live record of a running request (so the live dashboard and the final one are the same numbers).

Gradio keeps each queued event's ``enqueue_time`` (``time.monotonic()``) on its queue object; the handler finds
its own event by the session that sent it.  Both reach into objects other modules own (Gradio's queue,
the engine's request stream): each access is guarded and degrades to "not measured" rather than failing a run.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Sequence

from cosyvoice_fast.serving.store import engine_record

log = logging.getLogger(__name__)


def gradio_queue_wait(request: Any, blocks: Any, fn_name: str = "synthesize") -> float:
    """Seconds the calling event waited in Gradio's queue before its handler started (0.0 when unknown)."""
    started = time.monotonic()
    session = getattr(request, "session_hash", None)
    queue = getattr(blocks, "_queue", None)
    events = getattr(queue, "event_ids_to_events", None)
    if not session or not events:
        return 0.0
    try:
        mine = [e for e in list(events.values()) if e.session_hash == session
                and getattr(getattr(e, "fn", None), "name", fn_name) == fn_name and e.enqueue_time <= started]
    except (AttributeError, RuntimeError):  # Gradio changed its internals, or the dict changed while read
        return 0.0
    if not mine:
        return 0.0
    # the newest event of this session for this function is the one running now (a session runs one at a time)
    return max(0.0, started - max(e.enqueue_time for e in mine))


def set_app_queue(stream: Any, seconds: float) -> None:
    """Record the front end's queue wait on the request's telemetry (before its first chunk: TTFB includes it)."""
    rec = engine_record(stream)
    if rec is not None:
        rec.app_queue_s = max(0.0, float(seconds))


def count_input_refusals(blocks: Any, metrics: Any, fn_names: Sequence[str] = ("synthesize", "ab")) -> None:
    """Count as ``rejected`` the events of ``fn_names`` that Gradio itself refuses before the handler runs (its
    input preprocessing: a file that was not uploaded by a user, a value a component cannot take, too few
    inputs); otherwise /metrics would miss them, as the engine never sees them."""
    if metrics is None or getattr(blocks, "_cosyvoice_counted", False):
        return
    original = blocks.preprocess_data

    @functools.wraps(original)
    async def preprocess_data(block_fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(block_fn, *args, **kwargs)
        except Exception:
            if getattr(block_fn, "name", None) in fn_names:
                metrics.count_rejected("GradioInputError")
            raise

    blocks.preprocess_data = preprocess_data
    blocks._cosyvoice_counted = True
