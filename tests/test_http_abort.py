"""A raw-PCM HTTP stream that ends early ends quietly: one log line, no traceback, the engine request cancelled.

Two ways a started ``response_format=pcm`` stream can break, each on a real uvicorn server over the tiny synthetic
model (CPU): the client leaves mid-stream (its engine request must be cancelled so the slot frees), or the server
must abort it (the engine shut down mid-utterance: the client must see a broken transfer, never a clean end).
Either way the log gets one line from the API naming the request, and uvicorn's "Exception in ASGI application"
traceback must not appear.  uvicorn's loggers do not propagate to the root logger, so the test listens on
``uvicorn.error`` itself as well as on the root.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
from helpers import tiny_api

httpx = pytest.importorskip("httpx")  # not on the GPU box: this module must still collect there (test_gpu_collection)

BODY = {"input": "Hello there, a sentence long enough to be cut off mid-stream.", "response_format": "pcm",
        "max_tokens": 2000, "token_hop_len_first": 10, "token_hop_len": 10, "seed": 5}
API_LOGGER = "cosyvoice_fast.serving.http"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _recording() -> Iterator[list[logging.LogRecord]]:
    """Every record of the root logger and of uvicorn's error logger (which does not propagate) inside the block.
    Entered once the server runs: uvicorn's logging set-up replaces its loggers' handlers when it starts."""
    rec = _Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error"), logging.getLogger(API_LOGGER)]
    old = [lg.level for lg in loggers]
    for lg in loggers[:2]:
        lg.addHandler(rec)
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    try:
        yield rec.records
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)
        for lg in loggers[:2]:
            lg.removeHandler(rec)


def _voice() -> str:
    from cosyvoice_fast.serving.voices import bundled_voices

    return next(v.id for v in bundled_voices().values() if v.mode == "cross_lingual")


def _wait_outcome(base: str, rid: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        t = httpx.get(f"{base}/v1/requests/{rid}/telemetry", timeout=30).json()
        if t["outcome"] != "running" or time.monotonic() > deadline:
            return t
        time.sleep(0.1)


def _tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in records if r.exc_info or "Exception in ASGI" in r.getMessage()]


def _api_lines(records: list[logging.LogRecord], rid: str) -> list[logging.LogRecord]:
    return [r for r in records if r.name == API_LOGGER and rid in r.getMessage()]


@contextmanager
def _started_pcm_stream(tmp_path) -> Iterator[tuple[Any, str, httpx.Response, Iterator[bytes], list]]:
    """A server, its log records and one ``pcm`` stream whose first chunk has been read: (service, base url,
    response, the rest of its body, records).  The records stop 0.5 s after the stream is left (the server logs
    the closed connection by then)."""
    with tiny_api(tmp_path) as (svc, port), _recording() as logs, httpx.Client(timeout=120) as c:
        base = f"http://127.0.0.1:{port}"
        with c.stream("POST", f"{base}/v1/audio/speech", json={**BODY, "voice": _voice()}) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()
            assert len(next(chunks)) > 0
            yield svc, base, r, chunks, logs
        time.sleep(0.5)


def test_client_abort_mid_pcm_stream_is_one_info_line_and_frees_the_slot(tmp_path):
    with _started_pcm_stream(tmp_path) as (svc, base, r, _, logs):
        rid = r.headers["x-request-id"]
        r.close()  # the client leaves mid-stream: the connection closes
        t = _wait_outcome(base, rid)
        deadline = time.monotonic() + 60
        while svc.engine.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = svc.engine.stats()
    assert t["outcome"] == "cancelled" and t["telemetry"]["cancelled"] is True
    assert len(t["telemetry"]["token_times"]) < BODY["max_tokens"]  # stopped, not run to the end
    assert stats["active"] == 0 and stats["queued"] == 0
    lines = _api_lines(logs, rid)
    assert [(r.levelno, r.getMessage()) for r in lines] == \
        [(logging.INFO, f"request {rid}: client disconnected; cancelled")]
    assert _tracebacks(logs) == []
    assert [r.getMessage() for r in logs if r.levelno >= logging.WARNING] == []


def test_server_abort_of_a_pcm_stream_breaks_the_transfer_without_a_traceback(tmp_path):
    from cosyvoice_fast.engine.scheduler import EngineClosed
    from cosyvoice_fast.serving.errors import engine_error

    with _started_pcm_stream(tmp_path) as (svc, base, r, chunks, logs):
        rid = r.headers["x-request-id"]
        svc.engine.close()  # the server goes away mid-utterance
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            for _ in chunks:
                pass
    reason = engine_error(EngineClosed("the engine was shut down")).message  # what the API says of a shutdown
    lines = _api_lines(logs, rid)
    assert [(r.levelno, r.getMessage()) for r in lines] == [(logging.WARNING, f"request {rid} ended early: {reason}")]
    assert _tracebacks(logs) == []
