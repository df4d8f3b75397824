"""The bi-streaming WebSocket: text pieces in as an agent writes them, audio out while it still writes.

``/v1/audio/speech/stream`` (mounted by :func:`cosyvoice_fast.serving.http.create_api_router` beside the HTTP routes):

1. the client sends a JSON start message: ``{"type": "start", "voice": ..., ...}`` with the options of
   ``POST /v1/audio/speech`` except ``input`` (voice, prompt_text, mode, seed, max_tokens, chunk parameters;
   ``response_format`` may only be ``pcm``: the socket sends PCM16 frames);
2. then any number of ``{"type": "text", "text": "..."}`` messages (a plain text frame counts as one too), and
   ``{"type": "end"}`` when the text is complete;
3. the server sends each audio chunk as a binary frame of PCM16 little-endian mono samples at the rate given in
   its ``{"type": "ready", "request_id": ..., "sample_rate": ...}`` reply, and ``{"type": "done", "telemetry":
   {...}}`` at the end.  ``request_id`` is issued by the server (the start message's own ``request_id`` is only a
   label, echoed as ``label``): the connection, and whoever holds that id, own the request; nothing else can
   cancel or read it.

Bad input gets ``{"type": "error", "error": {...}}`` (OpenAI's error shape, as the HTTP API) and the socket is
closed: 1008 for bad input, 4408 when the client was too slow (no ``start`` within
:attr:`WsLimits.start_timeout_s`, or no message for :attr:`WsLimits.idle_timeout_s` before ``end``), 1013 when a
client address has :attr:`WsLimits.max_per_client` sockets open or the engine is full, 1011 for an engine failure
(the only server error).  Every refusal is counted in ``cosyvoice_api_errors``.  A client that disconnects, even
mid-text, cancels the request: its LM stops within a step and its slot is freed.  Waiting for text or audio holds
no thread of the server's pool (:mod:`cosyvoice_fast.serving.aio`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
from collections import Counter
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cosyvoice_fast.serving.aio import next_chunk, open_stream
from cosyvoice_fast.serving.errors import engine_error
from cosyvoice_fast.serving.speech_request import ApiError, bad, parse_speech, synthesis_request
from cosyvoice_fast.serving.store import api_store, engine_record
from cosyvoice_fast.telemetry.record import now

log = logging.getLogger(__name__)
PATH = "/v1/audio/speech/stream"
CLOSE_BAD_INPUT, CLOSE_TOO_SLOW, CLOSE_TRY_LATER, CLOSE_SERVER_ERROR = 1008, 4408, 1013, 1011


@dataclasses.dataclass(frozen=True)
class WsLimits:
    """What one client may hold: seconds to send ``start`` after connecting, seconds between messages before
    ``end``, and sockets open at once per client address."""

    start_timeout_s: float = 5.0
    idle_timeout_s: float = 30.0
    max_per_client: int = 8

    def __post_init__(self) -> None:
        if not (self.start_timeout_s > 0 and self.idle_timeout_s > 0 and self.max_per_client >= 1):
            raise ValueError(f"WsLimits needs positive timeouts and max_per_client >= 1, got {self}")


def pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> PCM16 little-endian bytes (clipped)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _message(raw: dict[str, Any]) -> tuple[str, str]:
    """A client message -> (kind, text); raises :class:`ApiError` naming what was wrong."""
    if "bytes" in raw and raw.get("bytes") is not None:
        raise bad("message", "binary frames are not accepted: send text as JSON {\"type\": \"text\", \"text\": ...}")
    data = raw.get("text") or ""
    try:
        msg = json.loads(data)
    except (json.JSONDecodeError, RecursionError):
        return "text", data  # a plain text frame is a piece of text
    if not isinstance(msg, dict) or msg.get("type") not in ("text", "end"):
        raise bad("type", "each message after start is {\"type\": \"text\", \"text\": \"...\"} or {\"type\": \"end\"}")
    if msg["type"] == "end":
        return "end", ""
    if not isinstance(msg.get("text"), str):
        raise bad("text", "a text message needs 'text' as a string")
    return "text", msg["text"]


def _start_request(svc: Any, raw: dict[str, Any], pieces: "queue.Queue[str | None]", rid: str) -> tuple[Any, Any]:
    """The start message -> (a :class:`SynthesisRequest` whose text is ``pieces`` and id ``rid``, its label)."""
    try:
        start = json.loads(raw.get("text") or "")
    except (json.JSONDecodeError, RecursionError):
        start = None
    if not isinstance(start, dict) or start.get("type") != "start":
        raise bad("type", "the first message must be JSON {\"type\": \"start\", \"voice\": ..., ...options}")
    body = {k: v for k, v in start.items() if k != "type"}
    if "input" in body:
        raise bad("input", "'input' is not used here: send the text in {\"type\": \"text\"} messages")
    if body.get("response_format", "pcm") != "pcm":
        raise bad("response_format", f"response_format {body['response_format']!r} is not available on the "
                                     "WebSocket, which sends raw PCM16 frames: send 'pcm' (or leave it out), or use "
                                     "POST /v1/audio/speech for encoded audio")
    if body.get("stream_format", "audio") != "audio":
        raise bad("stream_format", "stream_format does not apply to the WebSocket: leave it out")
    params = parse_speech({**body, "response_format": "pcm", "input": "-"})
    speakers = svc.frontend.list_speakers() if svc.frontend is not None else []
    req = synthesis_request(params, speakers, svc.engine.default_backend)
    return dataclasses.replace(req, text="", text_source=pieces, request_id=rid), params.request_id


def _count(svc: Any, err: ApiError) -> None:
    metrics = getattr(svc, "metrics", None)
    if metrics is not None and hasattr(metrics, "count_api_error"):
        metrics.count_api_error(err.status, err.code or "error")


async def _send_error(ws: WebSocket, svc: Any, err: ApiError, code: int) -> None:
    _count(svc, err)
    try:
        await ws.send_json({"type": "error", **err.body()})
        await ws.close(code=code)
    except Exception:  # noqa: BLE001 - the client may already be gone
        pass


def _close_code(err: ApiError) -> int:
    if err.status == 408:
        return CLOSE_TOO_SLOW
    if err.status in (429, 503):
        return CLOSE_TRY_LATER
    return CLOSE_SERVER_ERROR if err.status >= 500 else CLOSE_BAD_INPUT


def add_ws_routes(router: APIRouter, get_service: Callable[[], Any], limits: WsLimits | None = None) -> None:
    """Add the bi-streaming WebSocket route to ``router``."""
    lim = limits or WsLimits()
    open_by_client: Counter[str] = Counter()

    @router.websocket(PATH)
    async def speech_stream(ws: WebSocket) -> None:
        svc = get_service()
        host = ws.client.host if ws.client is not None else "-"
        await ws.accept()
        if open_by_client[host] >= lim.max_per_client:
            await _send_error(ws, svc, ApiError(429, f"this client already has {lim.max_per_client} WebSockets "
                                                     "open: close one (or finish its text) before opening another",
                                                code="too_many_sockets"), CLOSE_TRY_LATER)
            return
        open_by_client[host] += 1
        try:
            await _serve(ws, svc, lim)
        finally:
            open_by_client[host] -= 1
            if open_by_client[host] <= 0:
                del open_by_client[host]


async def _serve(ws: WebSocket, svc: Any, lim: WsLimits) -> None:
    store = api_store(svc)
    received = now()
    rid = store.new_id()
    pieces: queue.Queue = queue.Queue()
    try:
        first = await asyncio.wait_for(ws.receive(), lim.start_timeout_s)
        if first.get("type") == "websocket.disconnect":
            return
        req, label = _start_request(svc, first, pieces, rid)
    except asyncio.TimeoutError:
        await _send_error(ws, svc, ApiError(408, f"no start message within {lim.start_timeout_s:g} s of connecting: "
                                                 "send {\"type\": \"start\", ...} right after opening the socket",
                                            code="start_timeout"), CLOSE_TOO_SLOW)
        return
    except ApiError as e:
        await _send_error(ws, svc, e, CLOSE_BAD_INPUT)
        return
    except WebSocketDisconnect:
        return
    live = store.start(rid, received, label)
    await ws.send_json({"type": "ready", "request_id": rid, "label": label, "sample_rate": svc.engine.sample_rate})
    gone = asyncio.Event()
    chars = {"n": 0, "record": None}

    async def receive() -> None:
        try:
            while True:
                try:
                    raw = await asyncio.wait_for(ws.receive(), lim.idle_timeout_s)
                except asyncio.TimeoutError:
                    raise ApiError(408, f"no message for {lim.idle_timeout_s:g} s before 'end': send the next text "
                                        "piece sooner, or {\"type\": \"end\"} when the text is complete",
                                   code="idle_timeout") from None
                if raw.get("type") == "websocket.disconnect":
                    break
                kind, text = _message(raw)
                if kind == "end":
                    pieces.put(None)
                    return
                chars["n"] += len(text)
                if chars["record"] is not None:
                    chars["record"].params["chars"] = chars["n"]
                pieces.put(text)
        except ApiError as e:
            await _send_error(ws, svc, e, _close_code(e))
        except Exception:  # noqa: BLE001 - a dropped connection
            pass
        gone.set()
        svc.engine.cancel(rid)  # the server-issued id: only this connection's request

    reader = asyncio.ensure_future(receive())
    stream = None
    try:
        stream = await open_stream(svc.engine, req)
        live.cancel = stream.close
        record = engine_record(stream)
        if record is not None:  # the request log's chars= counts the text that came in
            record.params = {**record.params, "chars": chars["n"], "label": label}
            chars["record"] = record
            record.app_queue_s = max(0.0, record.received - received)
        tele = None
        gone_wait = asyncio.ensure_future(gone.wait())
        while True:
            nxt = asyncio.ensure_future(next_chunk(stream))
            await asyncio.wait([nxt, gone_wait], return_when=asyncio.FIRST_COMPLETED)
            if gone.is_set():  # the client left (or sent bad input): cancel, even before the first chunk
                nxt.cancel()
                stream.close()
                break
            chunk = nxt.result()
            if chunk is None:
                break
            store.add_chunk(live, chunk)
            tele = chunk.telemetry or tele
            await ws.send_bytes(pcm16(chunk.samples))
        gone_wait.cancel()
        if not gone.is_set():
            summary = tele.to_dict() if tele is not None else {}
            await ws.send_json({"type": "done", "request_id": rid, "telemetry": summary})
            await ws.close()
    except Exception as e:  # noqa: BLE001 - refused or failed: a JSON error, then close
        if not gone.is_set():
            err = engine_error(e)
            if err.status >= 500:
                log.error("WebSocket request %s failed: %s", rid, err.message)
            store.finish(rid, "error" if err.status >= 500 else "rejected", error=err.message)
            await _send_error(ws, svc, err, _close_code(err))
    finally:
        if stream is not None:
            stream.close()
        reader.cancel()
        gone.set()
