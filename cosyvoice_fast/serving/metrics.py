"""Prometheus metrics and a readiness document for one loaded service, and the two HTTP routes serving them.

Everything is fed by the engine's finished-request hook (:meth:`Engine.add_observer`): one observation per
request, from the same telemetry the dashboard draws, so the numbers agree with what users see.  Each
:class:`EngineMetrics` owns its own ``CollectorRegistry`` (nothing is registered in prometheus_client's global
registry), so two services in one process, or tests that build many, never collide.

``GET /health`` answers 200 with JSON when the model is loaded and the engine's worker is running, else 503
(a readiness probe); ``GET /metrics`` is the Prometheus text exposition.  Both are mounted on the Gradio app by
:func:`cosyvoice_fast.app.page.serve` and need no login: they carry aggregate numbers only (no text, audio, names
or paths).
"""

from __future__ import annotations

import math
import time
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)

from cosyvoice_fast.telemetry.record import RequestTelemetry

TTFB_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """Counters and histograms of one engine, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("cosyvoice_requests", "Synthesis requests by outcome (ok, cancelled, error, "
                                "rejected = refused before synthesis, e.g. bad input)", ["outcome"], registry=r)
        self.errors = Counter("cosyvoice_request_errors", "Failed or refused requests by error type", ["type"],
                              registry=r)
        self.ttfb = Histogram("cosyvoice_ttfb_seconds", "Time from request to first audio chunk delivered",
                              buckets=TTFB_BUCKETS, registry=r)
        self.rtf = Histogram("cosyvoice_rtf", "Real-time factor of completed requests (wall time / audio time)",
                             buckets=RTF_BUCKETS, registry=r)
        self.audio = Counter("cosyvoice_audio_seconds", "Seconds of audio delivered", registry=r)
        self.chunks = Counter("cosyvoice_chunks", "Audio chunks delivered", registry=r)
        self.underruns = Counter("cosyvoice_underruns", "Chunks delivered after their playback deadline",
                                 registry=r)
        self.active = Gauge("cosyvoice_active_requests", "Requests queued or running in the engine", registry=r)
        self.queue_depth = Gauge("cosyvoice_queue_depth", "Requests waiting in the engine's admission queue",
                                 registry=r)
        self.queue_wait = Histogram("cosyvoice_queue_wait_seconds", "Time a request waited in the engine's admission "
                                    "queue for a free slot (the TTFB stage 'admission')", buckets=WAIT_BUCKETS,
                                    registry=r)
        self.refused = Counter("cosyvoice_refused", "Requests refused because the engine's admission queue was full "
                               "(EngineBusy; HTTP 429/503)", registry=r)
        self.api_errors = Counter("cosyvoice_api_errors", "Error answers of the /v1 HTTP and WebSocket routes by "
                                  "status and code (parse errors, refusals, WebSocket timeouts and limits, failed "
                                  "encodes, 5xx)", ["status", "code"], registry=r)
        for o in ("ok", "cancelled", "error", "rejected"):
            self.requests.labels(o)  # present (at 0) from the start, so rates work before the first failure
        # the serving process: resident memory, CPU seconds, open file descriptors (Linux /proc), start time
        ProcessCollector(registry=r)

    def attach(self, engine: Any) -> "EngineMetrics":
        """Observe ``engine``'s requests and read its queue figures from ``engine.stats()`` at scrape time."""
        engine.add_observer(self.observe)

        def count(*keys: str) -> float:
            st = engine.stats()
            return float(sum(st[k] for k in keys))

        self.active.set_function(lambda: count("active", "queued"))
        self.queue_depth.set_function(lambda: count("queued"))
        return self

    def observe(self, tele: RequestTelemetry, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        if tele.error:
            self.errors.labels(tele.error.split(":", 1)[0] or "Error").inc()
            if outcome == "rejected" and tele.error.startswith("EngineBusy"):
                self.refused.inc()
        wait = queue_wait(tele)
        if math.isfinite(wait):
            self.queue_wait.observe(wait)
        delivered = [c for c in tele.chunks if math.isfinite(c.delivered)]
        if delivered and math.isfinite(tele.ttfb):
            self.ttfb.observe(max(0.0, tele.ttfb))
        self.chunks.inc(len(delivered))
        self.audio.inc(sum(c.audio_seconds for c in delivered))
        if outcome == "ok":
            if math.isfinite(tele.rtf):
                self.rtf.observe(tele.rtf)
            self.underruns.inc(sum(r["underrun"] for r in tele.chunk_report()))

    def count_rejected(self, error_type: str = "InputError") -> None:
        """A request refused before it reached the engine (e.g. the app's own input checks)."""
        self.requests.labels("rejected").inc()
        self.errors.labels(error_type).inc()

    def count_api_error(self, status: int, code: str) -> None:
        """An error answer of the API (HTTP status, or the WebSocket's equivalent) with its OpenAI ``code``."""
        self.api_errors.labels(str(status), code).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def queue_wait(tele: RequestTelemetry) -> float:
    """Seconds ``tele``'s request waited in the engine's admission queue (``admitted - frontend_done``); 0 when
    it started without a wait (no ``admitted`` stamp but it reached prefill), nan when it never got that far."""
    if not math.isfinite(tele.frontend_done):
        return math.nan
    if math.isfinite(tele.admitted):
        return max(0.0, tele.admitted - tele.frontend_done)
    return 0.0 if math.isfinite(tele.prefill_start) else math.nan


def health(service: Any) -> dict[str, Any]:
    """Readiness of ``service``: ``ready`` is True when the model is loaded and the engine accepts work."""
    from cosyvoice_fast.engine.stages import available_backends, family_of_models

    engine = service.engine
    stats = engine.stats()
    running = bool(stats["running"])
    models = service.models
    backends: dict[str, list[str]] = {}
    family = family_of_models(models)
    for b in available_backends(models.device, family=family):
        if b.available:
            backends.setdefault(b.stage, []).append(b.name)
    startup = getattr(service, "startup", None)  # engine.startup.StartupProgress (None: not tracked)
    warming = list(getattr(service, "warming", lambda: [])())  # start-up work still running (service.start_warmup)
    return {"ready": bool(running) and not warming,
            "status": ("warming up: " + ", ".join(warming)) if running and warming
            else "ok" if running else "engine stopped", "warming": warming,
            "model_loaded": models is not None, "model": service.model_name, "family": family,
            "synthetic": bool(service.synthetic),
            "device": str(models.device), "dtype": str(models.dtype).replace("torch.", ""),
            "frontend": service.frontend is not None, "backends": backends,
            "backends_built": sorted(f"{c['llm']}/{c['flow']}/{c['vocoder']} {c['dtype']}"
                                     + ("" if c["incremental"] else " recompute") for c in stats["stage_configs"]),
            "active_requests": stats["active"] + stats["queued"], "queued_requests": stats["queued"],
            "sample_rate": engine.sample_rate,
            "startup": startup.snapshot() if startup is not None else None,  # phase, graphs N/M, estimate
            "time": time.time()}


def http_routes(service: Any) -> list[Any]:
    """Starlette routes ``GET /health`` and ``GET /metrics`` for ``service`` (mounted by ``webui.serve``)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def health_endpoint(request: Request) -> Response:
        h = health(service)
        return JSONResponse(h, status_code=200 if h["ready"] else 503)

    async def metrics_endpoint(request: Request) -> Response:
        m = getattr(service, "metrics", None)
        if m is None:
            return Response("metrics are not enabled for this service\n", status_code=404, media_type="text/plain")
        return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)

    return [Route("/health", health_endpoint, methods=["GET"]), Route("/metrics", metrics_endpoint, methods=["GET"])]
