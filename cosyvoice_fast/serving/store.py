"""What the HTTP API remembers about its requests, by request id, in bounded memory.

- Telemetry of finished requests (``GET /v1/requests/{id}/telemetry``): the engine's own record and its outcome,
  plus what the listener's page reported (``heard_ms``: click to first sample played).  The last
  ``max_requests`` are kept.
- Live requests: the chunks of a request still streaming, so another consumer (the app's Gradio event, which
  draws the dashboard for the stream the page plays) can follow the same request without synthesising it twice.
  Audio samples are kept only for the last ``keep_audio`` requests.

Thread-safe: the API appends from the event loop, followers read from Gradio's worker threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.telemetry.record import RequestTelemetry


def engine_record(stream: Any) -> RequestTelemetry | None:
    """The engine's own :class:`RequestTelemetry` of a running request (filled in as it runs), or None when the
    stream carries none (a remote engine's stream, a test double): readers then degrade to "not measured"."""
    rec = getattr(stream, "telemetry", None)
    return rec if isinstance(rec, RequestTelemetry) else None


@dataclass
class LiveRequest:
    """One API request as it streams: chunks so far, and how it ended."""

    request_id: str
    received: float
    chunks: list[AudioChunk] = field(default_factory=list)
    telemetry: RequestTelemetry | None = None  # the engine's record, once the request is over
    outcome: str | None = None  # ok, cancelled, error, rejected (None while running)
    error: str | None = None
    client: dict[str, float] = field(default_factory=dict)  # figures the page measured (heard_ms)

    def partial(self) -> RequestTelemetry:
        """The engine's record when finished, else one built from the chunk timings so far."""
        if self.telemetry is not None:
            return self.telemetry
        t = RequestTelemetry(self.request_id, received=self.received)
        t.chunks = [c.timing for c in self.chunks]
        return t

    def to_dict(self) -> dict[str, Any]:
        d = self.partial().to_dict()
        d["client"] = dict(self.client)
        return {"request_id": self.request_id, "outcome": self.outcome or "running", "error": self.error,
                "telemetry": d}


class RequestStore:
    """Bounded map request id -> :class:`LiveRequest`, with a condition to wait on."""

    def __init__(self, max_requests: int = 512, keep_audio: int = 8):
        self.max_requests, self.keep_audio = max_requests, keep_audio
        self._items: OrderedDict[str, LiveRequest] = OrderedDict()
        self._cv = threading.Condition()

    def start(self, request_id: str, received: float) -> LiveRequest:
        with self._cv:
            live = LiveRequest(request_id, received)
            self._items[request_id] = live
            self._items.move_to_end(request_id)
            self._trim()
            self._cv.notify_all()
            return live

    def add_chunk(self, live: LiveRequest, chunk: AudioChunk) -> None:
        with self._cv:
            live.chunks.append(chunk)
            self._cv.notify_all()

    def finish(self, request_id: str, outcome: str, telemetry: RequestTelemetry | None = None,
               error: str | None = None) -> LiveRequest:
        """Record the end of a request (creates the entry for one refused before it started)."""
        with self._cv:
            live = self._items.get(request_id)
            if live is None:
                live = LiveRequest(request_id, telemetry.received if telemetry else time.perf_counter())
                self._items[request_id] = live
            if live.outcome is None:
                live.outcome, live.error = outcome, error
            live.telemetry = telemetry or live.telemetry
            self._trim()
            self._cv.notify_all()
            return live

    def observe(self, telemetry: RequestTelemetry, outcome: str) -> None:
        """Engine observer: every request's final record lands here (API or app), with its outcome."""
        self.finish(telemetry.request_id, outcome, telemetry, telemetry.error)

    def report_client(self, request_id: str, figures: dict[str, float]) -> LiveRequest | None:
        with self._cv:
            live = self._items.get(request_id)
            if live is not None:
                live.client.update(figures)
                self._cv.notify_all()
            return live

    def get(self, request_id: str) -> LiveRequest | None:
        with self._cv:
            return self._items.get(request_id)

    def follow(self, request_id: str, start_timeout: float = 10.0) -> Iterator[AudioChunk]:
        """Yield the request's chunks as they arrive (waiting up to ``start_timeout`` s for it to appear); the
        iteration ends when the request does.  ``TimeoutError`` if it never appears."""
        deadline = time.monotonic() + start_timeout
        seen = 0
        with self._cv:
            while (live := self._items.get(request_id)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"request {request_id} did not reach the API within {start_timeout:g} s")
                self._cv.wait(left)
        while True:
            with self._cv:
                while seen >= len(live.chunks) and live.outcome is None:
                    self._cv.wait(1.0)
                new = live.chunks[seen:]
                seen += len(new)
                over = live.outcome is not None and seen >= len(live.chunks)
            yield from new
            if over:
                return

    def wait_client(self, request_id: str, key: str, timeout: float) -> float | None:
        """The page's figure ``key`` of the request, waiting up to ``timeout`` s for the report."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                live = self._items.get(request_id)
                if live is not None and key in live.client:
                    return live.client[key]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def _trim(self) -> None:
        while len(self._items) > self.max_requests:
            self._items.popitem(last=False)
        for live in list(self._items.values())[:-self.keep_audio]:
            if live.outcome is not None and live.chunks:
                live.chunks = [AudioChunk(c.samples[:0], c.index, c.segment, c.sample_rate, c.is_last, c.timing)
                               for c in live.chunks]

