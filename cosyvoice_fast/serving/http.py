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
import dataclasses
import json
import logging
import math
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from cosyvoice_fast.serving.speech_request import (
    ApiError, SpeechParams, bad, parse_speech, require_encoder, synthesis_request,
)
from cosyvoice_fast.serving.store import LiveRequest, RequestStore, api_store, engine_record
from cosyvoice_fast.serving.voices import voice_list
from cosyvoice_fast.serving.audio_encode import MEDIA_TYPES, make_encoder
from cosyvoice_fast.serving.errors import engine_error
from cosyvoice_fast.serving.aio import next_chunk, open_stream
from cosyvoice_fast.serving.auth import auth_dependency
from cosyvoice_fast.serving.body import parse_json, read_body, read_raw
from cosyvoice_fast.serving.stream_abort import StreamAborted, quiet_stream_aborts
from cosyvoice_fast.serving.ws import WsLimits, add_ws_routes
from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.telemetry.record import now

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected."""


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _count(svc: Any, status: int, code: str | None) -> None:
    metrics = getattr(svc, "metrics", None)
    if metrics is not None and hasattr(metrics, "count_api_error"):
        metrics.count_api_error(status, code or "error")


def _route_class(get_service: Callable[[], Any]) -> type[APIRoute]:
    """Routes whose :class:`ApiError` (raised in the handler or a dependency such as auth) becomes OpenAI's
    error JSON instead of FastAPI's ``{"detail": ...}``, and whose unexpected failures are a logged 500 in the
    same shape; every error response is counted in /metrics (``cosyvoice_api_errors``)."""

    class _ApiRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    response = await handler(request)
                except ApiError as e:
                    response = error_response(e)
                    _count(get_service(), e.status, e.code)
                    return response
                except Exception as e:  # noqa: BLE001 - a bug: logged, answered in the API's shape, counted
                    log.exception("%s %s failed", request.method, request.url.path)
                    _count(get_service(), 500, "internal_error")
                    return error_response(ApiError(500, f"internal error ({type(e).__name__}); the server log "
                                                        "has the details", code="internal_error"))
                if response.status_code >= 500:
                    _count(get_service(), response.status_code, "engine_error")
                return response

            return guarded

    return _ApiRoute


def _json(raw: bytes, param: str) -> Any:
    return parse_json(raw, param)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was already read, so the next message is the disconnect)."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _next_chunk(stream: Any, watcher: asyncio.Future) -> AudioChunk | None:
    """The stream's next chunk (None at its end); ``ClientGone`` (and the request cancelled) if the client
    leaves first."""
    fut = asyncio.ensure_future(next_chunk(stream))
    done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
        return fut.result()
    fut.cancel()
    stream.close()  # thread-safe: the worker drops the request
    raise ClientGone


async def _admit(engine: Any, req: Any, watcher: asyncio.Future) -> Any:
    """Open the request's stream (frontend + admission); a request whose client left meanwhile is closed."""
    fut = asyncio.ensure_future(open_stream(engine, req))
    done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if fut in done:
        return fut.result()
    fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else f.result().close())
    raise ClientGone


def _with_id(response: Response, rid: str, err: ApiError | None = None, svc: Any = None) -> Response:
    """An error response carrying the request's id (its telemetry says why it was refused)."""
    response.headers["X-Request-Id"] = rid
    if err is not None and svc is not None:
        _count(svc, err.status, err.code)
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _usage(live: LiveRequest) -> dict[str, Any]:
    t = live.partial()
    return {"audio_seconds": round(t.audio_seconds, 3), "chunks": len(t.chunks),
            "ttfb_ms": round(t.ttfb * 1e3, 1) if math.isfinite(t.ttfb) else None}


def create_api_router(get_service: Callable[[], Any], ws_limits: WsLimits | None = None) -> APIRouter:
    """Every ``/v1`` route, bound to the service ``get_service()`` returns (no authentication here)."""
    router = APIRouter(route_class=_route_class(get_service))
    quiet_stream_aborts()  # an aborted audio response is logged as one line below, not as uvicorn's traceback
    add_ws_routes(router, get_service, ws_limits)  # bi-streaming: text pieces in, audio out, one WebSocket

    @router.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        svc = get_service()
        store = api_store(svc)
        received = now()
        rid = store.new_id()  # the server's id: the only address of this request (a capability)
        session = request.headers.get("x-session") or None
        body: Any = {}
        try:
            if session is not None and not store.has_session(session):
                raise bad("X-Session", "unknown session: get one from POST /v1/sessions (sessions are kept while "
                                       "the server runs), or send no X-Session header", code="unknown_session")
            body = await read_body(request)
            params = parse_speech(body)
            require_encoder(params.response_format)  # the WebSocket route sends pcm16 and needs no encoder
            speakers = svc.frontend.list_speakers() if svc.frontend is not None else []
            req = dataclasses.replace(synthesis_request(params, speakers, svc.engine.default_backend),
                                      request_id=rid)
        except ApiError as e:
            label = body.get("request_id") if isinstance(body, dict) else None
            store.start(rid, received, label if isinstance(label, str) else None, session)
            store.finish(rid, "rejected", error=e.message)
            metrics = getattr(svc, "metrics", None)
            if metrics is not None:
                metrics.count_rejected("ApiError")
            return _with_id(error_response(e), rid, e, svc)
        live = store.start(rid, received, params.request_id, session)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            stream = await _admit(svc.engine, req, watcher)
            live.cancel = stream.close  # the owner's Stop (the bearer of rid, or of session.label)
            record = engine_record(stream)
            if record is not None:  # reading and checking the body came before the engine saw it: a TTFB stage
                record.app_queue_s = max(0.0, record.received - received)
                record.params["label"] = params.request_id
                live.telemetry = record  # followers (the app's dashboard) see the engine's record as it fills
            first = await _next_chunk(stream, watcher)
        except ClientGone:
            watcher.cancel()
            store.finish(rid, "cancelled")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - refused or failed before any audio: an HTTP error
            watcher.cancel()
            err = engine_error(e)
            if err.status == 500:
                log.exception("request %s failed before its first chunk", rid)
            store.finish(rid, "rejected" if err.status < 500 else "error", error=err.message)
            return _with_id(error_response(err), rid)
        if first is None:
            watcher.cancel()
            stream.close()
            store.finish(rid, "error", error="the engine produced no audio for this request")
            return _with_id(error_response(ApiError(500, "the engine produced no audio for this request")), rid)
        headers = {"X-Request-Id": rid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                   "X-Sample-Rate": str(svc.engine.sample_rate)}
        sse = params.stream_format == "sse"
        media = "text/event-stream" if sse else MEDIA_TYPES[params.response_format]
        chunks = _stream_body(params, stream, first, watcher, store, live, svc)
        return StreamingResponse(chunks, media_type=media, headers=headers)

    @router.post("/v1/sessions")
    async def new_session() -> dict[str, Any]:
        """A session key: requests sent with ``X-Session: <key>`` may be addressed as ``<key>.<request_id>``
        by whoever holds the key (the page hands its own requests to its dashboard this way)."""
        return {"session": api_store(get_service()).new_session()}

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
        body = _json(await read_raw(request, limit=16384), "body")
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


class _EncodeFailed(Exception):
    """The encoder raised: the request ends as an error (not ``ok``), whatever the engine delivered."""


async def _stream_body(params: SpeechParams, stream: Any, first: AudioChunk, watcher: asyncio.Future,
                       store: RequestStore, live: LiveRequest, svc: Any) -> AsyncIterator[bytes]:
    """Encode and send each chunk as it comes; SSE wraps the same bytes in base64 delta events and ends with a
    done event carrying the usage and the request's telemetry.  A failure after the response started (engine
    error, server shutdown, encoder failure) ends SSE with an ``error`` event and aborts a raw audio response
    (the client sees a broken transfer, never a clean end of a cut-off utterance)."""
    enc = make_encoder(params.response_format, svc.engine.sample_rate)
    sse = params.stream_format == "sse"
    chunk: AudioChunk | None = first
    last: AudioChunk | None = None
    tail: bytes | None = None
    try:
        while chunk is not None:
            store.add_chunk(live, chunk)
            last = chunk
            try:
                data = enc.encode(chunk.samples)
                if chunk.is_last:  # before the end marker is read, so a failing trailer is not counted ok
                    tail = enc.finish()
            except Exception as e:  # noqa: BLE001
                raise _EncodeFailed(f"{type(e).__name__}: {e}") from e
            if data:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
            chunk = await _next_chunk(stream, watcher)
        if tail is None:
            try:
                tail = enc.finish()
            except Exception as e:  # noqa: BLE001
                raise _EncodeFailed(f"{type(e).__name__}: {e}") from e
        if sse:
            if tail:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
            tele = last.telemetry if last is not None and last.telemetry is not None else live.partial()
            yield _sse({"type": "speech.audio.done", "request_id": live.request_id, "usage": _usage(live),
                        "telemetry": tele.to_dict()})
        elif tail:
            yield tail
    except (ClientGone, asyncio.CancelledError, GeneratorExit) as e:
        # the client left: seen by our watcher (ClientGone), or by the server, which cancels the response task
        # (CancelledError) or drops this generator (GeneratorExit); either way ``finally`` cancels the request
        log.info("request %s: client disconnected; cancelled", live.request_id)
        if not isinstance(e, ClientGone):
            raise
    except Exception as e:  # noqa: BLE001 - after the headers: tell the client in-band or abort the transfer
        if isinstance(e, _EncodeFailed):
            err = ApiError(500, f"the audio could not be encoded as {params.response_format} ({e}); ask for "
                                "response_format 'pcm' or 'wav'", code="encode_failed")
            if hasattr(stream, "fail"):
                stream.fail(f"EncodeError: {e}")
            log.error("request %s: encoding %s failed: %s", live.request_id, params.response_format, e)
        else:
            err = engine_error(e)
            if err.status >= 500 and err.code != "unavailable":
                log.error("request %s failed mid-stream: %s", live.request_id, err.message)
            else:
                log.warning("request %s ended early: %s", live.request_id, err.message)
        store.finish(live.request_id, "error", error=err.message)
        _count(svc, err.status, err.code)
        if not sse:  # a broken transfer, logged above as one line (uvicorn's traceback of it is filtered)
            raise StreamAborted(err.message) from e
        yield _sse({"type": "error", "request_id": live.request_id, **err.body()})
    finally:  # no awaits here: this also runs when the server cancels the response task
        watcher.cancel()
        stream.close()
        if hasattr(enc, "close"):
            enc.close()


def mount_api(app: FastAPI, service: Any, auth: Any = None, ws_limits: WsLimits | None = None) -> None:
    """Add the ``/v1`` routes of ``service`` to ``app``, behind ``auth`` when given, ahead of the app's own routes
    (so a catch-all of the host app cannot shadow them; works before or after the server started).  With
    ``auth``, the app's ``/openapi.json`` needs the same login."""
    router = create_api_router(lambda: service, ws_limits)
    check = auth_dependency(app, auth) if auth else None
    deps = [Depends(check)] if check else None
    if check is not None and getattr(app, "openapi_url", None):
        router.add_api_route(app.openapi_url, lambda: JSONResponse(app.openapi()), methods=["GET"],
                             include_in_schema=False)
    before = len(app.router.routes)
    app.include_router(router, dependencies=deps)
    added = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = added
    api_store(service)
