"""The OpenAI-compatible streaming HTTP API: ``POST /v1/audio/speech``, ``GET /v1/audio/voices`` and the telemetry
of a request by id.

``create_api_router(get_service)`` returns a FastAPI router with every ``/v1`` route and no authentication (the
app, a Ray Serve replica and the WebSocket server mount the same router); ``mount_api(app, service, auth)`` adds it
to an app behind the same login as the page (a Gradio session cookie, or ``Authorization: Bearer user:password``
/ HTTP Basic for programs such as the ``openai`` client).

Streaming: the response starts when the engine hands over the first chunk (so an engine refusal or a bad prompt is
still an HTTP error with a status, not a broken stream) and every later chunk is encoded and sent the moment it
exists.  A client that disconnects cancels its engine request at once (a watcher on the connection wakes the
request's consumer, and the engine drops it before its next step).  Every request gets an ``X-Request-Id``; its
TTFB split is at ``GET /v1/requests/{id}/telemetry`` and, with ``stream_format=sse``, in the final event.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import secrets
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocketException
from fastapi.requests import HTTPConnection
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from cosyvoice_fast.serving.speech_request import (
    MAX_BODY_BYTES, ApiError, SpeechParams, bad, parse_speech, require_encoder, synthesis_request,
)
from cosyvoice_fast.serving.store import LiveRequest, RequestStore, engine_record
from cosyvoice_fast.serving.voices import voice_list
from cosyvoice_fast.serving.audio_encode import MEDIA_TYPES, make_encoder
from cosyvoice_fast.serving.errors import engine_error
from cosyvoice_fast.serving.ws import add_ws_routes
from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.telemetry.record import now

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected."""


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _ApiRoute(APIRoute):
    """Routes whose :class:`ApiError` (raised in the handler or a dependency such as auth) becomes OpenAI's
    error JSON instead of FastAPI's ``{"detail": ...}``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e)

        return guarded


def api_store(service: Any) -> RequestStore:
    """The request store of ``service`` (made on first use; observes the engine so every request's final
    telemetry is kept by id)."""
    store = getattr(service, "_api_store", None)
    if store is None:
        store = RequestStore()
        service.engine.add_observer(store.observe)
        service._api_store = store  # per service (not a field of Service: owned by the app's start-up code)
    return store


async def _read_body(request: Request) -> dict[str, Any]:
    """JSON or multipart form (file part ``prompt_audio``) -> a dict; 413 past the size limit."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {int(length) / 2**20:.1f} MB; at most {MAX_BODY_BYTES // 2**20} MB "
                            "are accepted (the prompt audio should be 3 to 10 s)", param="prompt_audio",
                       code="body_too_large")
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data") or ctype.startswith("application/x-www-form-urlencoded"):
        form = await request.form(max_part_size=MAX_BODY_BYTES)
        out: dict[str, Any] = {}
        for key, value in form.multi_items():
            out[key] = await value.read() if hasattr(value, "read") else value
        if isinstance(out.get("backends"), str) and out["backends"].startswith("{"):
            out["backends"] = _json(out["backends"].encode(), "backends")
        return out
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES // 2**20} MB", param="prompt_audio",
                       code="body_too_large")
    return _json(raw, "body")


def _json(raw: bytes, param: str) -> Any:
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(param, f"{param} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}): send a JSON object "
                         "with Content-Type: application/json") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read, so the next message is the disconnect)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _next_chunk(stream: Any, watcher: asyncio.Future) -> AudioChunk | None:
    """The stream's next chunk (None at its end); ``ClientGone`` (and the request cancelled) if the client
    leaves first."""
    fut = asyncio.ensure_future(asyncio.to_thread(next, stream, None))
    done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
        return fut.result()
    stream.close()  # thread-safe: the worker drops the request and wakes the blocked `next`
    raise ClientGone


async def _admit(engine: Any, req: Any, watcher: asyncio.Future) -> Any:
    """``engine.stream(req)`` (frontend + admission) in a thread; a request whose client left meanwhile is closed."""
    fut = asyncio.ensure_future(asyncio.to_thread(engine.stream, req))
    done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
        return fut.result()
    fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else f.result().close())
    raise ClientGone


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _usage(live: LiveRequest) -> dict[str, Any]:
    t = live.partial()
    return {"audio_seconds": round(t.audio_seconds, 3), "chunks": len(t.chunks),
            "ttfb_ms": round(t.ttfb * 1e3, 1) if math.isfinite(t.ttfb) else None}


def create_api_router(get_service: Callable[[], Any]) -> APIRouter:
    """Every ``/v1`` route, bound to the service ``get_service()`` returns (no authentication here)."""
    router = APIRouter(route_class=_ApiRoute)
    add_ws_routes(router, get_service)  # bi-streaming: text pieces in, audio out, one WebSocket

    @router.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        svc = get_service()
        store = api_store(svc)
        received = now()
        body: Any = {}
        try:
            body = await _read_body(request)
            params = parse_speech(body)
            require_encoder(params.response_format)  # the WebSocket route sends pcm16 and needs no encoder
            speakers = svc.frontend.list_speakers() if svc.frontend is not None else []
            req = synthesis_request(params, speakers, svc.engine.default_backend)
        except ApiError as e:
            rid = body.get("request_id") if isinstance(body, dict) else None
            if isinstance(rid, str) and rid:
                store.finish(rid[:64], "rejected", error=e.message)
            metrics = getattr(svc, "metrics", None)
            if metrics is not None:
                metrics.count_rejected("ApiError")
            raise
        live = store.start(req.request_id, received)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            stream = await _admit(svc.engine, req, watcher)
            record = engine_record(stream)
            if record is not None:  # reading and checking the body came before the engine saw it: a TTFB stage
                record.app_queue_s = max(0.0, record.received - received)
                live.telemetry = record  # followers (the app's dashboard) see the engine's record as it fills
            first = await _next_chunk(stream, watcher)
        except ClientGone:
            watcher.cancel()
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - refused or failed before any audio: an HTTP error
            watcher.cancel()
            err = engine_error(e)
            if err.status == 500:
                log.exception("request %s failed before its first chunk", req.request_id)
            store.finish(req.request_id, "rejected", error=err.message)
            return error_response(err)
        if first is None:
            watcher.cancel()
            stream.close()
            return error_response(ApiError(500, "the engine produced no audio for this request"))
        headers = {"X-Request-Id": req.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                   "X-Sample-Rate": str(svc.engine.sample_rate)}
        sse = params.stream_format == "sse"
        media = "text/event-stream" if sse else MEDIA_TYPES[params.response_format]
        chunks = _stream_body(params, stream, first, watcher, store, live, svc.engine.sample_rate)
        return StreamingResponse(chunks, media_type=media, headers=headers)

    @router.get("/v1/audio/voices")
    async def voices() -> dict[str, Any]:
        svc = get_service()
        return {"voices": voice_list(svc.frontend), "sample_rate": svc.engine.sample_rate}

    @router.get("/v1/requests/{request_id}/telemetry")
    async def telemetry(request_id: str) -> dict[str, Any]:
        live = api_store(get_service()).get(request_id)
        if live is None:
            raise ApiError(404, f"no request {request_id!r} is known here (only the last "
                                f"{api_store(get_service()).max_requests} are kept)", param="request_id",
                           code="not_found")
        return live.to_dict()

    @router.post("/v1/requests/{request_id}/client")
    async def client_report(request_id: str, request: Request) -> dict[str, Any]:
        """The listener's page reports what it measured (``heard_ms``: click to first sample played)."""
        body = _json(await request.body(), "body")
        if not isinstance(body, dict) or not body:
            raise bad("body", "send a JSON object such as {\"heard_ms\": 512.3}")
        figures = {}
        for k, v in body.items():
            if k not in ("heard_ms", "first_byte_ms", "click_to_fetch_ms"):
                raise bad(k, f"unknown figure {k!r}; accepted: heard_ms, first_byte_ms, click_to_fetch_ms")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 3.6e6:
                raise bad(k, f"{k} must be a number of milliseconds from 0 to 3600000")
            figures[k] = float(v)
        if api_store(get_service()).report_client(request_id, figures) is None:
            raise ApiError(404, f"no request {request_id!r} is known here", param="request_id", code="not_found")
        return {"ok": True}

    return router


async def _stream_body(params: SpeechParams, stream: Any, first: AudioChunk, watcher: asyncio.Future,
                       store: RequestStore, live: LiveRequest, sample_rate: int) -> AsyncIterator[bytes]:
    """Encode and send each chunk as it comes; SSE wraps the same bytes in base64 delta events and ends with a
    done event carrying the usage and the request's telemetry."""
    enc = make_encoder(params.response_format, sample_rate)
    sse = params.stream_format == "sse"
    chunk: AudioChunk | None = first
    last: AudioChunk | None = None
    try:
        while chunk is not None:
            store.add_chunk(live, chunk)
            last = chunk
            data = enc.encode(chunk.samples)
            if data:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
            chunk = await _next_chunk(stream, watcher)
        tail = enc.finish()
        if sse:
            if tail:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
            tele = last.telemetry if last is not None and last.telemetry is not None else live.partial()
            yield _sse({"type": "speech.audio.done", "request_id": live.request_id, "usage": _usage(live),
                        "telemetry": tele.to_dict()})
        elif tail:
            yield tail
    except ClientGone:
        log.info("request %s: client disconnected; cancelled", live.request_id)
    finally:  # no awaits here: this also runs when the server cancels the response task
        watcher.cancel()
        stream.close()
        if hasattr(enc, "close"):
            enc.close()


def auth_dependency(app: Any, auth: Any) -> Callable:
    """A FastAPI dependency accepting the page's Gradio session cookie, ``Authorization: Bearer user:password``
    or HTTP Basic with one of ``auth``'s accounts (a ``(user, password)`` pair or a list of them)."""
    pairs = [auth] if isinstance(auth, tuple) and len(auth) == 2 and isinstance(auth[0], str) else list(auth)
    accounts = {str(u): str(p) for u, p in pairs}

    def valid(user: str, password: str) -> bool:
        ok = accounts.get(user)
        return ok is not None and secrets.compare_digest(ok.encode(), password.encode())

    async def check(request: HTTPConnection) -> None:  # a Request, or the WebSocket of the bi-streaming route
        header = request.headers.get("authorization", "")
        scheme, _, cred = header.partition(" ")
        if scheme.lower() == "bearer" and valid(*_split(cred.strip())):
            return
        if scheme.lower() == "basic":
            try:
                if valid(*_split(base64.b64decode(cred.strip()).decode())):
                    return
            except (binascii.Error, UnicodeDecodeError):
                pass
        tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
        if tokens is not None and cookie_id is not None:
            for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
                if request.cookies.get(name) in tokens:
                    return
        if request.scope.get("type") == "websocket":  # refused at the handshake; a close reason holds 123 bytes
            raise WebSocketException(code=1008, reason="not authenticated: send Authorization: Bearer user:password")
        raise ApiError(401, "not authenticated: this server runs with --auth; send 'Authorization: Bearer "
                            "user:password' (the openai client's api_key='user:password') or log in to the page",
                       code="invalid_api_key")

    return check


def _split(cred: str) -> tuple[str, str]:
    user, _, password = cred.partition(":")
    return user, password


def mount_api(app: FastAPI, service: Any, auth: Any = None) -> None:
    """Add the ``/v1`` routes of ``service`` to ``app``, behind ``auth`` when given, ahead of the app's own routes
    (so a catch-all of the host app cannot shadow them; works before or after the server started)."""
    router = create_api_router(lambda: service)
    deps = [Depends(auth_dependency(app, auth))] if auth else None
    before = len(app.router.routes)
    app.include_router(router, dependencies=deps)
    added = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = added
    api_store(service)
