"""How an engine refusal or failure becomes an API error: one mapping, shared by the HTTP and WebSocket routes so
both answer the same status and OpenAI error code for the same cause."""

from __future__ import annotations

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.engine.engine import EngineBusy, EngineClosed
from cosyvoice_fast.frontend.audio import PromptAudioError
from cosyvoice_fast.frontend.speaker import SpeakerCacheError
from cosyvoice_fast.frontend.text_normalize import EmptyTextError, TextTooLongError
from cosyvoice_fast.frontend.text_source import TextSourceTimeout
from cosyvoice_fast.serving.speech_request import ApiError, bad


def engine_error(e: BaseException) -> ApiError:
    """The :class:`ApiError` for an exception raised by ``engine.stream`` or a running request: 429 when full
    (the client should retry), 503 when shutting down, 400 naming the parameter for the frontend's and config's
    own ``ValueError``s (their messages say what to change), 500 otherwise."""
    if isinstance(e, EngineBusy):
        return ApiError(429, f"{e}", code="engine_busy")
    if isinstance(e, EngineClosed):
        return ApiError(503, "The server is shutting down: the request was ended before its audio was complete; "
                             "try another server or again later", code="unavailable")
    if isinstance(e, TextSourceTimeout):  # the client was too slow sending text: its error, not the server's
        return ApiError(408, str(e), param="text", code="text_timeout")
    if isinstance(e, BackendUnavailable):
        return bad("backends", str(e))
    if isinstance(e, ValueError):
        param = ("prompt_audio" if isinstance(e, PromptAudioError) else "voice" if isinstance(e, SpeakerCacheError)
                 else "input" if isinstance(e, (EmptyTextError, TextTooLongError)) else "backends"
                 if "backend" in str(e) else "input")
        return bad(param, str(e))
    return ApiError(500, f"synthesis failed: {type(e).__name__}: {e}", code="engine_error")
