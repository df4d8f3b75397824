"""One log line per request, for the operator: id, mode, characters, TTFB, RTF and outcome.

Fed by the engine's finished-request hook (:meth:`Engine.add_observer`), so every front end (the app, the CLI, an
HTTP API) gets the same line without logging anything itself.  A request refused before it reached the engine
(the app's own input checks) is logged by :func:`log_refused` in the same format.  User mistakes are one line at
INFO, never a traceback: they are not the server's failures.  Real failures (outcome ``error``) are WARNING.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cosyvoice_fast.telemetry.record import RequestTelemetry

log = logging.getLogger("cosyvoice_fast.requests")

WARMUP_PREFIX = "warmup-"  # request ids of the start-up warm-up (see service.Service.start_warmup)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if math.isfinite(seconds) else "-"


def _reason(text: str | None, limit: int = 200) -> str:
    """The first line of an error, shortened at a word boundary, quoted."""
    first = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " …"
    return '"' + first.replace('"', "'") + '"'


def format_line(tele: RequestTelemetry, outcome: str) -> str:
    """``request <id> mode=<m> chars=<n> ttfb=<ms> rtf=<x> audio=<s> outcome=<o> [error="..."]``."""
    p = tele.params or {}
    audio = sum(c.audio_seconds for c in tele.chunks if math.isfinite(c.delivered))
    rtf = tele.rtf if outcome == "ok" else math.nan
    parts = [f"request {tele.request_id}", f"mode={p.get('mode', '-')}", f"chars={p.get('chars', '-')}",
             f"ttfb={_ms(tele.ttfb)}", f"rtf={rtf:.3f}" if math.isfinite(rtf) else "rtf=-", f"audio={audio:.2f}s",
             f"outcome={outcome}"]
    if tele.error:
        parts.append(f"error={_reason(tele.error)}")
    return " ".join(parts)


def observe(tele: RequestTelemetry, outcome: str) -> None:
    """The engine observer: one line per finished, cancelled, failed or refused request."""
    level = logging.WARNING if outcome == "error" else logging.INFO
    log.log(level, format_line(tele, outcome))


def attach(engine: Any) -> None:
    """Log every request of ``engine`` (idempotent)."""
    engine.remove_observer(observe)
    engine.add_observer(observe)


def log_refused(request_id: str, mode: str, chars: int, reason: str) -> None:
    """A request the front end refused before the engine saw it (same format, outcome ``rejected``)."""
    log.info("request %s mode=%s chars=%d ttfb=- rtf=- audio=0.00s outcome=rejected error=%s", request_id, mode,
             chars, _reason(reason))
