"""What the HTTP API remembers about its requests, by request id, in bounded memory.

- Telemetry of finished requests (``GET /v1/requests/{id}/telemetry``): the engine's own record and its outcome,
  plus what the listener's page reported (``heard_ms``: click to first sample played).  The last
  ``max_requests`` are kept.
- Ownership: a request is addressed by the id the server issued to it (``secrets.token_urlsafe``, 128 random
  bits: knowing it is the capability), or by ``"<session>.<label>"`` where the session key was issued by the
  server (``POST /v1/sessions``) and the label is the client's own ``request_id`` inside that session.  A label
  alone addresses nothing, so two clients choosing the same ``request_id`` never see each other's request.
- Live requests: the chunks of a request still streaming, so another consumer (the app's Gradio event, which
  draws the dashboard for the stream the page plays) can follow the same request without synthesising it twice.
  Audio samples are kept only for the last ``keep_audio`` requests.

Thread-safe: the API appends from the event loop, followers read from Gradio's worker threads.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.telemetry.record import RequestTelemetry


def api_store(service: Any) -> "RequestStore":
    """The request store of ``service`` (made on first use; observes the engine so every API request's final
    telemetry is kept by id)."""
    store = getattr(service, "_api_store", None)
    if store is None:
        store = RequestStore()
        service.engine.add_observer(store.observe)
        service._api_store = store  # per service (not a field of Service: owned by the app's start-up code)
    return store


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
    label: str | None = None  # the client's own request_id (a name inside its session, never an address)
    session: str | None = None
    chunks: list[AudioChunk] = field(default_factory=list)
    telemetry: RequestTelemetry | None = None  # the engine's record, once the request is over
    outcome: str | None = None  # ok, cancelled, error, rejected (None while running)
    error: str | None = None
    client: dict[str, float] = field(default_factory=dict)  # figures the page measured (heard_ms)
    cancel: Callable[[], None] | None = None  # cancels the running request (its own stream's close)

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
        return {"request_id": self.request_id, "label": self.label, "outcome": self.outcome or "running",
                "error": self.error, "telemetry": d}


class RequestStore:
    """Bounded map request id -> :class:`LiveRequest`, with a condition to wait on."""

    def __init__(self, max_requests: int = 512, keep_audio: int = 8, max_sessions: int = 4096):
        self.max_requests, self.keep_audio, self.max_sessions = max_requests, keep_audio, max_sessions
        self._items: OrderedDict[str, LiveRequest] = OrderedDict()
        self._labels: dict[tuple[str, str], str] = {}  # (session, label) -> server-issued id
        self._sessions: OrderedDict[str, None] = OrderedDict()
        self._cv = threading.Condition()

    @staticmethod
    def new_id() -> str:
        """A server-issued request id: 128 random bits, URL-safe (22 characters)."""
        return secrets.token_urlsafe(16)

    def new_session(self) -> str:
        """Issue a session key (128 random bits): labels sent with it address that session's requests only."""
        key = secrets.token_urlsafe(16)
        with self._cv:
            self._sessions[key] = None
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return key

    def has_session(self, key: str | None) -> bool:
        with self._cv:
            return bool(key) and key in self._sessions

    def start(self, request_id: str, received: float, label: str | None = None,
              session: str | None = None) -> LiveRequest:
        """Register a request under its server-issued id (and ``session.label`` when both are given)."""
        with self._cv:
            live = LiveRequest(request_id, received, label=label, session=session)
            self._items[request_id] = live
            self._items.move_to_end(request_id)
            if session and label:
                self._labels[(session, label)] = request_id
            self._trim()
            self._cv.notify_all()
            return live

    def _resolve(self, address: str) -> LiveRequest | None:
        """The request ``address`` names: a server-issued id, or ``"<session>.<label>"`` (caller holds the lock)."""
        live = self._items.get(address)
        if live is not None:
            return live
        session, dot, label = address.partition(".")
        rid = self._labels.get((session, label)) if dot else None
        return self._items.get(rid) if rid is not None else None

    def cancel(self, address: str) -> bool:
        """Cancel the running request ``address`` names (only the bearer of its id or its session can)."""
        with self._cv:
            live = self._resolve(address)
            stop = live.cancel if live is not None and live.outcome is None else None
        if stop is not None:
            stop()
        return stop is not None

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
            live.cancel = None
            live.telemetry = telemetry or live.telemetry
            self._trim()
            self._cv.notify_all()
            return live

    def observe(self, telemetry: RequestTelemetry, outcome: str) -> None:
        """Engine observer: the final record of each API request lands here, with its outcome (requests that
        did not come through the API, e.g. the app's own runs, are not kept: nothing else may address them)."""
        with self._cv:
            if telemetry.request_id not in self._items:
                return
        self.finish(telemetry.request_id, outcome, telemetry, telemetry.error)

    def report_client(self, request_id: str, figures: dict[str, float]) -> LiveRequest | None:
        with self._cv:
            live = self._resolve(request_id)
            if live is not None:
                live.client.update(figures)
                self._cv.notify_all()
            return live

    def get(self, request_id: str) -> LiveRequest | None:
        with self._cv:
            return self._resolve(request_id)

    def follow(self, request_id: str, start_timeout: float = 10.0) -> Iterator[AudioChunk]:
        """Yield the request's chunks as they arrive (waiting up to ``start_timeout`` s for it to appear); the
        iteration ends when the request does.  ``TimeoutError`` if it never appears."""
        deadline = time.monotonic() + start_timeout
        seen = 0
        with self._cv:
            while (live := self._resolve(request_id)) is None:
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
                live = self._resolve(request_id)
                if live is not None and key in live.client:
                    return live.client[key]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def _trim(self) -> None:
        while len(self._items) > self.max_requests:
            _, old = self._items.popitem(last=False)
            if old.session and old.label and self._labels.get((old.session, old.label)) == old.request_id:
                del self._labels[(old.session, old.label)]
        for live in list(self._items.values())[:-self.keep_audio]:
            if live.outcome is not None and live.chunks:
                live.chunks = [AudioChunk(c.samples[:0], c.index, c.segment, c.sample_rate, c.is_last, c.timing)
                               for c in live.chunks]

