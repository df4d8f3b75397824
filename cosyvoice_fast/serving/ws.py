"""The bi-streaming WebSocket: text pieces in as an agent writes them, audio out while it still writes.

``/v1/audio/speech/stream`` (mounted by :func:`cosyvoice_fast.serving.http.create_api_router` beside the HTTP routes):

1. the client sends a JSON start message: ``{"type": "start", "voice": ..., ...}`` with the options of
   ``POST /v1/audio/speech`` except ``input`` (voice, prompt_text, mode, seed, max_tokens, chunk parameters);
2. then any number of ``{"type": "text", "text": "..."}`` messages (a plain text frame counts as one too), and
   ``{"type": "end"}`` when the text is complete;
3. the server sends each audio chunk as a binary frame of PCM16 little-endian mono samples at the rate given in
   its ``{"type": "ready", "sample_rate": ...}`` reply, and ``{"type": "done", "telemetry": {...}}`` at the end.

Bad input gets ``{"type": "error", "error": {...}}`` (OpenAI's error shape, as the HTTP API) and the socket is
closed (1008 for bad input, 1011 for an engine failure).  A client that disconnects, even mid-text, cancels the
request: its LM stops within a step and its slot is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cosyvoice_fast.serving.errors import engine_error
from cosyvoice_fast.serving.speech_request import ApiError, bad, parse_speech, synthesis_request

log = logging.getLogger(__name__)
PATH = "/v1/audio/speech/stream"


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
    except json.JSONDecodeError:
        return "text", data  # a plain text frame is a piece of text
    if not isinstance(msg, dict) or msg.get("type") not in ("text", "end"):
        raise bad("type", "each message after start is {\"type\": \"text\", \"text\": \"...\"} or {\"type\": \"end\"}")
    if msg["type"] == "end":
        return "end", ""
    if not isinstance(msg.get("text"), str):
        raise bad("text", "a text message needs 'text' as a string")
    return "text", msg["text"]


def _start_request(svc: Any, raw: dict[str, Any], pieces: "queue.Queue[str | None]") -> Any:
    """The start message -> a :class:`SynthesisRequest` whose text is ``pieces``."""
    try:
        start = json.loads(raw.get("text") or "")
    except json.JSONDecodeError:
        start = None
    if not isinstance(start, dict) or start.get("type") != "start":
        raise bad("type", "the first message must be JSON {\"type\": \"start\", \"voice\": ..., ...options}")
    body = {k: v for k, v in start.items() if k != "type"}
    if "input" in body:
        raise bad("input", "'input' is not used here: send the text in {\"type\": \"text\"} messages")
    params = parse_speech({**body, "input": "-"})
    speakers = svc.frontend.list_speakers() if svc.frontend is not None else []
    req = synthesis_request(params, speakers, svc.engine.default_backend)
    return dataclasses.replace(req, text="", text_source=pieces)


async def _send_error(ws: WebSocket, err: ApiError, code: int) -> None:
    try:
        await ws.send_json({"type": "error", **err.body()})
        await ws.close(code=code)
    except Exception:  # noqa: BLE001 - the client may already be gone
        pass


def add_ws_routes(router: APIRouter, get_service: Callable[[], Any]) -> None:
    """Add the bi-streaming WebSocket route to ``router``."""

    @router.websocket(PATH)
    async def speech_stream(ws: WebSocket) -> None:
        svc = get_service()
        await ws.accept()
        pieces: queue.Queue = queue.Queue()
        try:
            req = _start_request(svc, await ws.receive(), pieces)
        except ApiError as e:
            await _send_error(ws, e, 1008)
            return
        except WebSocketDisconnect:
            return
        await ws.send_json({"type": "ready", "request_id": req.request_id, "sample_rate": svc.engine.sample_rate})
        gone = asyncio.Event()

        async def receive() -> None:
            try:
                while True:
                    raw = await ws.receive()
                    if raw.get("type") == "websocket.disconnect":
                        break
                    kind, text = _message(raw)
                    if kind == "end":
                        pieces.put(None)
                        return
                    pieces.put(text)
            except ApiError as e:
                await _send_error(ws, e, 1008)
            except Exception:  # noqa: BLE001 - a dropped connection
                pass
            gone.set()
            svc.engine.cancel(req.request_id)

        reader = asyncio.ensure_future(receive())
        stream = None
        try:
            stream = await asyncio.to_thread(svc.engine.stream, req)
            tele = None
            gone_wait = asyncio.ensure_future(gone.wait())
            while True:
                nxt = asyncio.ensure_future(asyncio.to_thread(next, stream, None))
                await asyncio.wait([nxt, gone_wait], return_when=asyncio.FIRST_COMPLETED)
                if gone.is_set():  # the client left (or sent bad input): cancel, even before the first chunk
                    stream.close()
                    break
                chunk = nxt.result()
                if chunk is None:
                    break
                tele = chunk.telemetry or tele
                await ws.send_bytes(pcm16(chunk.samples))
            if not gone.is_set():
                summary = tele.to_dict() if tele is not None else {}
                await ws.send_json({"type": "done", "telemetry": summary})
                await ws.close()
        except Exception as e:  # noqa: BLE001 - refused or failed: a JSON error, then close
            if not gone.is_set():
                err = engine_error(e)
                await _send_error(ws, err, 1011 if err.status >= 500 else 1008)
        finally:
            if stream is not None:
                stream.close()
            reader.cancel()
            gone.set()
