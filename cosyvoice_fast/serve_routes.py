"""The ``/v1/audio/...`` routes a Serve replica mounts: the HTTP API module's router when it exists, else a minimal
stand-in with the same contract.

The HTTP API (``cosyvoice_fast.http_api.create_api_router(get_service)``) is built on another branch; a replica
must serve the very same routes, so it takes that router as is.  Until that module is present the stand-in here
serves ``POST /v1/audio/speech`` (saved voices, raw 24 kHz 16-bit PCM or a streaming WAV) and
``GET /v1/audio/voices``, enough to run and test the cluster; it goes away once the real module lands.
"""

from __future__ import annotations

import logging
import struct
from typing import Any, Callable, Iterator

import numpy as np
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

GetService = Callable[[], Any]


class SpeechBody(BaseModel):
    """The OpenAI speech request (``voice`` is a saved speaker) with the engine's seed and token cap."""

    model: str = "cosyvoice2"
    input: str
    voice: str
    response_format: str = "pcm"
    speed: float = 1.0
    seed: int = Field(0, ge=0)
    max_tokens: int | None = None
    token_hop_len_first: int | None = None


def api_router(get_service: GetService) -> Any:
    """The project's ``/v1`` router for ``get_service`` (the stand-in where ``http_api`` is not there yet)."""
    try:
        from .http_api import create_api_router
    except ImportError:
        log.info("cosyvoice_fast.http_api not found: serving the stand-in /v1/audio routes")
        return standin_router(get_service)
    return create_api_router(get_service)


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """float [-1, 1] -> little-endian int16 bytes (what ``response_format=pcm`` streams)."""
    return (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A mono 16-bit WAV header whose sizes say "unknown" (0xFFFFFFFF), as streaming players expect."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                                 sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def standin_router(get_service: GetService) -> Any:
    """``POST /v1/audio/speech`` and ``GET /v1/audio/voices`` on a loaded service (no auth inside)."""
    from fastapi import APIRouter, HTTPException
    from fastapi.responses import StreamingResponse

    from .config import StreamParams
    from .engine import EngineBusy
    from .request import SynthesisRequest

    router = APIRouter()

    @router.get("/v1/audio/voices")
    def voices() -> dict:
        fe = get_service().frontend
        return {"voices": sorted(fe.list_speakers()) if fe is not None else []}

    @router.post("/v1/audio/speech")
    def speech(body: SpeechBody) -> StreamingResponse:
        svc = get_service()
        if body.response_format not in ("pcm", "wav"):
            raise HTTPException(400, f"response_format {body.response_format!r} is not served here: use pcm or wav")
        try:
            params = StreamParams() if body.token_hop_len_first is None else StreamParams(
                token_hop_len_first=body.token_hop_len_first)
            req = SynthesisRequest(text=body.input, mode="speaker", speaker=body.voice, seed=body.seed,
                                   max_tokens=body.max_tokens, stream=True, stream_params=params)
            stream = svc.engine.stream(req)  # the frontend runs here: a bad voice is a 400, not a broken stream
        except EngineBusy as e:
            raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from e
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        sr = svc.engine.sample_rate

        def body_bytes() -> Iterator[bytes]:
            try:
                if body.response_format == "wav":
                    yield streaming_wav_header(sr)
                for chunk in stream:
                    yield pcm16_bytes(chunk.samples)
            finally:
                stream.close()

        media = "audio/wav" if body.response_format == "wav" else "audio/pcm"
        return StreamingResponse(body_bytes(), media_type=media, headers={"X-Sample-Rate": str(sr)})

    return router
