"""A service that lives elsewhere: the Gradio app as a front end of a Serve cluster (``app.py --backend-url``).

:class:`RemoteService` has the shape the app's handlers use of a loaded :class:`~cosyvoice_fast.serving.service.Service`
(``engine.stream``, ``engine.sample_rate``, ``frontend.list_speakers``, ``models.device``, ``banner``...), but
every request goes to the cluster's ``POST /v1/audio/speech`` (saved or bundled voices by name, an uploaded
prompt as base64) and streams back raw PCM, so one page fronts every replica.  Saving or deleting voices is refused
with a message saying where they live (the cluster's shared speaker directory).  The page's backend choices are
not sent: each replica runs its own default (cudagraph on a GPU), which the page cannot see from here.

Timing seen from here is the listener's: TTFB is measured at this server, from sending the request to holding
the first bytes; the engine's stage split stays on the replica (its metrics), so the page shows the whole TTFB as
one "handoff" stage.  A replica that dies mid-stream ends the stream with an error naming what happened.
"""

from __future__ import annotations

import base64
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import numpy as np
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.engine.engine import EngineBusy
from cosyvoice_fast.frontend.request import AudioChunk, SynthesisRequest
from cosyvoice_fast.telemetry.record import ChunkTiming, RequestTelemetry, now

log = logging.getLogger(__name__)



class RemoteStreamError(RuntimeError):
    """The cluster stopped a stream part-way (its replica died or the connection broke)."""


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
        d = body.get("detail") or body.get("error") or body
        return d.get("message", str(d)) if isinstance(d, dict) else str(d)
    except Exception:  # noqa: BLE001 - plain-text answers (Serve's own 503) are the message as is
        return r.text.strip() or f"HTTP {r.status_code}"


def _prompt_b64(source: Any) -> str:
    if isinstance(source, (str, Path)):
        source = Path(source).read_bytes()
    if not isinstance(source, bytes):
        raise ValueError("a prompt voice must be an audio file or its bytes to travel to the cluster")
    return base64.b64encode(source).decode()


def request_body(req: SynthesisRequest, model: str) -> dict[str, Any]:
    """The HTTP API body of ``req`` (raw 24 kHz PCM back; the replica's default backends)."""
    p = req.stream_params
    body: dict[str, Any] = {"model": model, "input": req.text, "response_format": "pcm", "mode": req.mode,
                            "seed": req.seed, "speed": req.speed, "token_hop_len_first": p.token_hop_len_first,
                            "token_hop_len": p.token_hop_len, "pre_lookahead_len": p.pre_lookahead_len,
                            "stream_scale_factor": p.stream_scale_factor, "request_id": req.request_id}
    if req.max_tokens is not None:
        body["max_tokens"] = req.max_tokens
    if req.mode == "speaker":
        body["voice"] = req.speaker
    else:
        body["prompt_audio"] = _prompt_b64(req.prompt_wav)
        if req.mode == "zero_shot":
            body["prompt_text"] = req.prompt_text
        if req.mode == "instruct2":
            body["instruction"] = req.instruct_text
    return body


class RemoteStream:
    """One streamed request: iterate for :class:`AudioChunk`s; ``telemetry`` fills in as they come (the app's
    handlers and the HTTP API read it live); ``close()`` drops the connection, which cancels it on the replica."""

    def __init__(self, engine: "RemoteEngine", response: httpx.Response, telemetry: RequestTelemetry) -> None:
        self.engine, self.response, self.telemetry = engine, response, telemetry
        self.request_id = telemetry.request_id
        self._chunks = self._read()
        self._outcome: str | None = None

    def __iter__(self) -> "RemoteStream":
        return self

    def __next__(self) -> AudioChunk:
        try:
            return next(self._chunks)
        except StopIteration:
            self._end("ok")
            raise
        except Exception:
            self._end("error")
            raise

    def close(self) -> None:
        self._chunks.close()
        self._end("cancelled")

    def _end(self, outcome: str) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self.telemetry.finished = now()
            self.engine._finished(self, outcome)

    def _read(self) -> Iterator[AudioChunk]:
        r, tele = self.response, self.telemetry
        rest, index = b"", 0
        try:
            try:
                for data in r.iter_raw():  # each read is handed on at once: holding one back would delay audio
                    data, rest = rest + data, b""
                    if len(data) % 2:
                        data, rest = data[:-1], data[-1:]
                    if data:
                        yield self._chunk(np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, index)
                        index += 1
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                tele.error = f"{type(e).__name__}: {e}"
                replica = r.headers.get("x-replica", "?")
                raise RemoteStreamError(f"the cluster's replica {replica} stopped this stream after {index} "
                                        f"chunks ({type(e).__name__}: the replica died or the connection broke); "
                                        "the other streams are unaffected: try again") from e
            # the body ended cleanly: an empty last chunk carries the record, as the engine's last chunk does
            end = ChunkTiming(index=index, segment=0, n_tokens=0, sample_rate=self.engine.sample_rate)
            yield AudioChunk(samples=np.zeros(0, np.float32), index=index, segment=0,
                             sample_rate=self.engine.sample_rate, is_last=True, timing=end, telemetry=tele)
        finally:
            r.close()

    def _chunk(self, samples: np.ndarray, index: int) -> AudioChunk:
        tele, t = self.telemetry, now()
        timing = ChunkTiming(index=index, segment=0, n_tokens=0, n_samples=len(samples),
                             sample_rate=self.engine.sample_rate, tokens_ready=t, flow_start=t, flow_end=t,
                             vocoder_end=t, delivered=t)
        if index == 0:  # no engine stamps here: the whole wait shows as one stage (see the module doc)
            tele.frontend_done = tele.admitted = tele.prefill_start = tele.prefill_done = tele.received
            timing.tokens_ready = timing.flow_start = timing.flow_end = timing.vocoder_end = tele.received
        tele.chunks.append(timing)
        return AudioChunk(samples=samples, index=index, segment=0, sample_rate=self.engine.sample_rate,
                          is_last=False, timing=timing)


class RemoteEngine:
    """The engine-shaped client of the cluster: ``stream``, ``cancel``, observers, ``stats`` (one replica's)."""

    def __init__(self, client: httpx.Client, sample_rate: int, model: str) -> None:
        self.client = client
        self.sample_rate = sample_rate
        self.model = model
        self.default_backend = BackendConfig()  # what the HTTP API parses against; never sent (module doc)
        self._observers: list[Any] = []
        self._open: dict[str, RemoteStream] = {}
        self._lock = threading.Lock()

    def stream(self, req: SynthesisRequest) -> RemoteStream:
        body = request_body(req, self.model)
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
        s = RemoteStream(self, r, tele)
        with self._lock:
            self._open[req.request_id] = s
        return s

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            s = self._open.get(request_id)
        if s is None:
            return False
        s.close()
        return True

    def add_observer(self, fn: Any) -> None:
        self._observers.append(fn)

    def remove_observer(self, fn: Any) -> None:
        if fn in self._observers:
            self._observers.remove(fn)

    def _finished(self, s: RemoteStream, outcome: str) -> None:
        with self._lock:
            self._open.pop(s.request_id, None)
        for fn in list(self._observers):
            try:
                fn(s.telemetry, outcome)
            except Exception:  # noqa: BLE001 - as in the engine: an observer never breaks a stream
                log.exception("observer %r failed", fn)

    def stats(self) -> dict[str, Any]:
        """The engine stats of whichever replica answers ``/health`` (``running`` False when none does)."""
        try:
            r = self.client.get("/health", timeout=5.0)
            st = dict(r.json().get("engine", {})) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            st = {}
        with self._lock:
            mine = len(self._open)
        return {"running": bool(st.get("running", False)), "active": mine, "queued": 0,
                "stage_sets": st.get("stage_sets", []), "stage_configs": st.get("stage_configs", []),
                "observers": len(self._observers), "max_active": st.get("max_active", 0)}

    def active_requests(self) -> int:
        with self._lock:
            return len(self._open)


@dataclass
class RemoteFrontend:
    """Saved voices of the cluster (listed over HTTP; saved and deleted on the cluster's speaker directory)."""

    client: httpx.Client

    def list_speakers(self) -> list[str]:
        """The cluster's saved speakers (its bundled voices are the replicas' to resolve, as here)."""
        r = self.client.get("/v1/audio/voices")
        r.raise_for_status()
        voices = r.json()
        voices = voices.get("voices", voices.get("data", [])) if isinstance(voices, dict) else voices
        return sorted(v if isinstance(v, str) else (v.get("name") or v.get("id")) for v in voices
                      if isinstance(v, str) or v.get("kind", "saved") == "saved")

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise ValueError("voices are saved on the cluster, not through this page: save them into the cluster's "
                         "shared --speaker-dir (python app.py on one replica's host, or copy the .safetensors "
                         "files there)")

    add_speaker = delete_speaker = _refuse

    def prompt_features(self, *_: Any, **__: Any) -> None:
        """Nothing to analyse here: the replica that gets the request analyses its prompt."""
        return None


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
    banner = (f"Front end of the Serve cluster at {url}: requests go to its replicas, which use their own "
              "backends (the backend choices here are ignored); voices are saved on the cluster.")
    if h.get("synthetic"):
        banner += " The cluster runs a SYNTHETIC model: the audio is noise, the timings are real."
    return RemoteService(url=url, engine=RemoteEngine(client, int(h.get("sample_rate", 24000)), model),
                         frontend=RemoteFrontend(client), model_name=f"{model} @ {url}",
                         synthetic=bool(h.get("synthetic")), banner=banner)
