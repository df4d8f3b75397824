"""A service that lives elsewhere: the Gradio app as a front end of a Serve cluster (``app.py --backend-url``).

:class:`RemoteService` has the shape the app's handlers use of a loaded :class:`~cosyvoice_fast.service.Service`
(``engine.stream``, ``engine.sample_rate``, ``frontend.list_speakers``, ``models.device``, ``banner``...), but
every request goes to the cluster's ``POST /v1/audio/speech`` and streams back raw PCM, so one page fronts every
replica.  What the HTTP API cannot carry is refused with a message that says what to do: prompt audio (only
saved voices travel by name), saving or deleting voices (they live in the cluster's shared speaker directory).

Timing seen from here is the listener's: TTFB is measured at this server, from sending the request to holding
the first bytes; the engine's stage split stays on the replica (its metrics), so the page shows the whole TTFB as
one "handoff" stage.  A replica that dies mid-stream ends the stream with an error naming what happened.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import numpy as np
import torch

from .engine import EngineBusy
from .request import AudioChunk, SynthesisRequest
from .telemetry import ChunkTiming, RequestTelemetry, now

log = logging.getLogger(__name__)

NOT_REMOTE = ("this page fronts a Serve cluster, whose HTTP API speaks with saved voices only: pick the 'saved "
              "speaker' mode (voices are saved in the cluster's --speaker-dir)")


class RemoteStreamError(RuntimeError):
    """The cluster stopped a stream part-way (its replica died or the connection broke)."""


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
        d = body.get("detail") or body.get("error") or body
        return d.get("message", str(d)) if isinstance(d, dict) else str(d)
    except Exception:  # noqa: BLE001 - plain-text answers (Serve's own 503) are the message as is
        return r.text.strip() or f"HTTP {r.status_code}"


class RemoteEngine:
    """``stream(request)`` over HTTP; closing the iterator closes the connection (the replica cancels)."""

    def __init__(self, client: httpx.Client, sample_rate: int, model: str) -> None:
        self.client = client
        self.sample_rate = sample_rate
        self.model = model
        self.default_backend = None

    def stream(self, req: SynthesisRequest) -> Iterator[AudioChunk]:
        if req.mode != "speaker" or not req.speaker:
            raise ValueError(NOT_REMOTE)
        body: dict[str, Any] = {"model": self.model, "input": req.text, "voice": req.speaker,
                                "response_format": "pcm", "seed": req.seed,
                                "token_hop_len_first": req.stream_params.token_hop_len_first}
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        tele = RequestTelemetry(req.request_id)
        r = self.client.send(self.client.build_request("POST", "/v1/audio/speech", json=body), stream=True)
        if r.status_code in (429, 503):
            r.read()
            r.close()
            raise EngineBusy(f"the cluster is full ({_detail(r)}): try again in a moment")
        if r.status_code != 200:
            r.read()
            r.close()
            raise ValueError(f"the cluster refused the request (HTTP {r.status_code}): {_detail(r)}")
        return self._chunks(r, tele)

    def _chunks(self, r: httpx.Response, tele: RequestTelemetry) -> Iterator[AudioChunk]:
        sr, rest, index = self.sample_rate, b"", 0
        try:
            try:
                for data in r.iter_raw():
                    data, rest = rest + data, b""
                    if len(data) % 2:
                        data, rest = data[:-1], data[-1:]
                    if not data:
                        continue
                    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
                    t = now()
                    timing = ChunkTiming(index=index, segment=0, n_tokens=0, n_samples=len(samples),
                                         sample_rate=sr, tokens_ready=t, flow_start=t, flow_end=t, vocoder_end=t,
                                         delivered=t)
                    if index == 0:  # no engine stamps here: the whole wait shows as one stage (see module doc)
                        tele.frontend_done = tele.admitted = tele.prefill_start = tele.prefill_done = tele.received
                        timing.tokens_ready = timing.flow_start = timing.flow_end = timing.vocoder_end = tele.received
                    tele.chunks.append(timing)
                    yield AudioChunk(samples=samples, index=index, segment=0, sample_rate=sr, is_last=False,
                                     timing=timing, telemetry=tele)
                    index += 1
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                replica = r.headers.get("x-replica", "?")
                raise RemoteStreamError(f"the cluster's replica {replica} stopped this stream after {index} "
                                        f"chunks ({type(e).__name__}: the replica died or the connection broke); "
                                        "the other streams are unaffected: try again") from e
            tele.finished = now()
        finally:
            r.close()


@dataclass
class RemoteFrontend:
    """Saved voices of the cluster (listed over HTTP; saved and deleted on the cluster's speaker directory)."""

    client: httpx.Client

    def list_speakers(self) -> list[str]:
        r = self.client.get("/v1/audio/voices")
        r.raise_for_status()
        voices = r.json()
        voices = voices.get("voices", voices.get("data", [])) if isinstance(voices, dict) else voices
        return sorted(v if isinstance(v, str) else (v.get("name") or v.get("id")) for v in voices)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise ValueError("voices are saved on the cluster, not through this page: save them into the cluster's "
                         "shared --speaker-dir (python app.py on one replica's host, or copy the .safetensors "
                         "files there)")

    add_speaker = delete_speaker = prompt_features = _refuse


@dataclass
class RemoteService:
    """The app-facing shape of a service whose engines run behind ``url``."""

    url: str
    engine: RemoteEngine
    frontend: RemoteFrontend
    model_name: str
    synthetic: bool
    banner: str
    models: Any = field(default_factory=lambda: SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    metrics: Any = None

    def health(self) -> dict:
        r = self.engine.client.get("/health")
        return {**r.json(), "backend_url": self.url} if r.status_code == 200 else {
            "ready": False, "status": f"backend {self.url} answered HTTP {r.status_code}", "backend_url": self.url}

    def close(self) -> None:
        self.engine.client.close()


def connect(url: str, timeout_s: float = 60.0) -> RemoteService:
    """A :class:`RemoteService` for the cluster at ``url`` (its ``/health`` must answer: fails fast otherwise)."""
    client = httpx.Client(base_url=url.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0))
    try:
        r = client.get("/health")
    except httpx.HTTPError as e:
        client.close()
        raise RuntimeError(f"--backend-url {url}: no answer ({type(e).__name__}: {e}); start the cluster with "
                           "python -m cosyvoice_fast serve --ray, or check the address") from e
    if r.status_code != 200:
        client.close()
        raise RuntimeError(f"--backend-url {url}: /health answered HTTP {r.status_code} ({_detail(r)})")
    h = r.json()
    model = str(h.get("model", "cosyvoice2"))
    banner = (f"Front end of the Serve cluster at {url}: requests go to its replicas (saved voices only; "
              "prompt uploads and voice saving happen on the cluster).")
    if h.get("synthetic"):
        banner += " The cluster runs a SYNTHETIC model: the audio is noise, the timings are real."
    return RemoteService(url=url, engine=RemoteEngine(client, int(h.get("sample_rate", 24000)), model),
                         frontend=RemoteFrontend(client), model_name=f"{model} @ {url}",
                         synthetic=bool(h.get("synthetic")), banner=banner)
