"""Per-request timestamps and the figures derived from them (what the dashboard and the benchmark show).

All times are ``time.perf_counter()`` seconds (monotonic).  The engine writes raw timestamps; everything else is
derived here, so the dashboard, the CLI table and the benchmark agree by construction.

TTFB is split into contiguous stages whose durations sum exactly to the measured TTFB:

    (front end's own queue: app_queue_s) received ─frontend→ frontend_done ─admission→ admitted
    ─queue→ prefill_start ─llm_prefill→ prefill_done
    ─llm_decode→ chunk0.tokens_ready ─queue→ chunk0.flow_start ─flow→ chunk0.flow_end
    ─vocoder→ chunk0.vocoder_end ─handoff→ chunk0.delivered

("app_queue" is time spent before the engine saw the request, in the serving front end's own queue (Gradio's, an
HTTP server's), measured by that front end and handed in as ``app_queue_s``; "admission" is the wait in the
engine's bounded admission queue for a free slot; "queue" is the time the admitted request waited for the GPU
worker, before prefill and between the first chunk's tokens existing and its flow starting.)  TTFB counts from
``received`` minus ``app_queue_s``: what the listener waited.  On a GPU every stage end is taken after synchronising the stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

STAGES = ("app_queue", "frontend", "admission", "queue", "llm_prefill", "llm_decode", "flow", "vocoder", "handoff")

now = time.perf_counter


@dataclass(slots=True)
class ChunkTiming:
    """Timestamps of one emitted audio chunk."""

    index: int
    segment: int
    n_tokens: int
    n_samples: int = 0
    sample_rate: int = 24000
    tokens_ready: float = math.nan
    flow_start: float = math.nan
    flow_end: float = math.nan
    vocoder_end: float = math.nan
    delivered: float = math.nan
    finalize: bool = False
    flow_mode: str = ""  # "incremental" (only the new frames) or "recompute" (prompt + every token so far)
    flow_frames: int = 0  # mel frames the flow's estimator ran for this chunk
    flow_state_bytes: int = 0  # the request's incremental flow state after this chunk (0: none kept)

    @property
    def audio_seconds(self) -> float:
        return self.n_samples / self.sample_rate

    @property
    def flow_ms(self) -> float:
        return (self.flow_end - self.flow_start) * 1e3

    @property
    def vocoder_ms(self) -> float:
        return (self.vocoder_end - self.flow_end) * 1e3

    @property
    def compute_ms(self) -> float:
        return (self.vocoder_end - self.flow_start) * 1e3


@dataclass(slots=True)
class RequestTelemetry:
    """Raw timestamps of one request; derived figures are methods."""

    request_id: str
    received: float = field(default_factory=now)
    app_queue_s: float = 0.0  # seconds waited in the front end's queue before ``received`` (0: none measured)
    frontend_done: float = math.nan
    admitted: float = math.nan  # left the engine's admission queue (nan: not yet; frontend_done when no wait)
    speaker_cache_hit: bool = False
    prefill_start: float = math.nan
    prefill_done: float = math.nan
    token_times: list[float] = field(default_factory=list)
    chunks: list[ChunkTiming] = field(default_factory=list)
    finished: float = math.nan
    cancelled: bool = False
    error: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    text_arrivals: list[float] = field(default_factory=list)  # bi-streaming: when each text piece arrived
    text_token5: float = math.nan  # bi-streaming: when the 5th text token reached the LM (it cannot decode before)

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def ttfb(self) -> float:
        """Seconds from the listener's request (receipt minus the front end's queue wait) to the consumer holding
        the first audio chunk (nan if none yet)."""
        return self.chunks[0].delivered - self.received + self.app_queue_s if self.chunks else math.nan

    def ttfb_breakdown(self) -> dict[str, float]:
        """Stage -> milliseconds; the values sum to ``ttfb`` (see the module docstring)."""
        if not self.chunks:
            return {s: math.nan for s in STAGES}
        c = self.chunks[0]
        ms = 1e3
        admitted = self.frontend_done if math.isnan(self.admitted) else self.admitted
        return {
            "app_queue": self.app_queue_s * ms,
            "frontend": (self.frontend_done - self.received) * ms,
            "admission": (admitted - self.frontend_done) * ms,
            "queue": ((self.prefill_start - admitted) + (c.flow_start - c.tokens_ready)) * ms,
            "llm_prefill": (self.prefill_done - self.prefill_start) * ms,
            "llm_decode": (c.tokens_ready - self.prefill_done) * ms,
            "flow": (c.flow_end - c.flow_start) * ms,
            "vocoder": (c.vocoder_end - c.flow_end) * ms,
            "handoff": (c.delivered - c.vocoder_end) * ms,
        }

    @property
    def first_audio_from_text(self) -> float:
        """Bi-streaming: seconds from the first text piece to the first audio chunk delivered (nan: none)."""
        if not self.text_arrivals or not self.chunks:
            return math.nan
        return self.chunks[0].delivered - self.text_arrivals[0]

    @property
    def first_audio_from_token5(self) -> float:
        """Bi-streaming: seconds from the 5th text token reaching the LM to the first audio delivered."""
        return self.chunks[0].delivered - self.text_token5 if self.chunks else math.nan

    @property
    def last_audio_lag(self) -> float:
        """Bi-streaming: seconds from the last text piece to the last audio chunk delivered."""
        if not self.text_arrivals or not self.chunks:
            return math.nan
        return self.chunks[-1].delivered - self.text_arrivals[-1]

    @property
    def audio_seconds(self) -> float:
        return sum(c.audio_seconds for c in self.chunks)

    @property
    def wall_seconds(self) -> float:
        end = self.finished if not math.isnan(self.finished) else (self.chunks[-1].delivered if self.chunks else now())
        return end - self.received

    @property
    def rtf(self) -> float:
        """Real-time factor: wall time / audio time (< 1 is faster than real time)."""
        a = self.audio_seconds
        return self.wall_seconds / a if a > 0 else math.nan

    @property
    def tokens_per_second(self) -> float:
        if len(self.token_times) < 2:
            return math.nan
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])

    def chunk_report(self) -> list[dict[str, Any]]:
        """Per chunk: tokens, audio seconds, compute ms, ready time vs playback deadline, underrun flag.

        Playback of chunk k starts when chunk 0 is delivered plus the audio length of chunks 0..k-1; the chunk
        underruns when it is delivered after that moment (the listener hears a gap).
        """
        out = []
        if not self.chunks:
            return out
        t0 = self.chunks[0].delivered
        played = 0.0
        for c in self.chunks:
            deadline = t0 + played
            out.append({
                "index": c.index, "segment": c.segment, "tokens": c.n_tokens, "audio_s": c.audio_seconds,
                "flow_ms": c.flow_ms, "vocoder_ms": c.vocoder_ms, "compute_ms": c.compute_ms,
                "ready_s": c.delivered - self.received, "deadline_s": deadline - self.received,
                "slack_ms": (deadline - c.delivered) * 1e3, "underrun": c.delivered > deadline + 1e-4,
                "finalize": c.finalize,
            })
            played += c.audio_seconds
        return out

    def summary(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "ttfb_ms": self.ttfb * 1e3, "rtf": self.rtf,
                "chunks": len(self.chunks), "tokens": len(self.token_times), "tokens_per_s": self.tokens_per_second,
                "audio_s": self.audio_seconds, "underruns": sum(r["underrun"] for r in self.chunk_report()),
                "speaker_cache_hit": self.speaker_cache_hit, "cancelled": self.cancelled, "error": self.error,
                **{f"params.{k}": v for k, v in self.params.items()}}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: raw timestamps relative to ``received`` plus the derived figures."""
        d = asdict(self)
        base = self.received
        d["token_times"] = [t - base for t in self.token_times]
        for k in ("frontend_done", "admitted", "prefill_start", "prefill_done", "finished"):
            d[k] = d[k] - base
        for c in d["chunks"]:
            for k in ("tokens_ready", "flow_start", "flow_end", "vocoder_end", "delivered"):
                c[k] = c[k] - base
        d["text_arrivals"] = [t - base for t in self.text_arrivals]
        d["text_token5"] = self.text_token5 - base
        d["received"] = 0.0
        d["derived"] = {"first_audio_from_text_ms": self.first_audio_from_text * 1e3,
                        "first_audio_from_token5_ms": self.first_audio_from_token5 * 1e3,
                        "last_audio_lag_ms": self.last_audio_lag * 1e3, "ttfb_ms": self.ttfb * 1e3, "ttfb_breakdown_ms": self.ttfb_breakdown(),
                        "chunks": self.chunk_report(), "rtf": self.rtf, "tokens_per_s": self.tokens_per_second}
        return _json_safe(d)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile of the finite values (nan when there are none)."""
    v = sorted(x for x in values if isinstance(x, (int, float)) and math.isfinite(x))
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def aggregate(requests: Iterable[RequestTelemetry]) -> dict[str, Any]:
    """p50/p95 of TTFB, each TTFB stage, RTF and tokens/s over many requests."""
    reqs = [r for r in requests if r.chunks]
    out: dict[str, Any] = {"n": len(reqs)}
    series = {"ttfb_ms": [r.ttfb * 1e3 for r in reqs], "rtf": [r.rtf for r in reqs],
              "tokens_per_s": [r.tokens_per_second for r in reqs],
              "flow_ms_per_chunk": [c.flow_ms for r in reqs for c in r.chunks],
              "vocoder_ms_per_chunk": [c.vocoder_ms for r in reqs for c in r.chunks]}
    for s in STAGES:
        series[f"ttfb.{s}_ms"] = [r.ttfb_breakdown()[s] for r in reqs]
    for k, vals in series.items():
        out[k] = {"p50": percentile(vals, 50), "p95": percentile(vals, 95), "mean": _mean(vals)}
    return out


def _mean(vals: list[float]) -> float:
    v = [x for x in vals if math.isfinite(x)]
    return sum(v) / len(v) if v else math.nan


def format_breakdown(t: RequestTelemetry) -> str:
    """A small text table of the TTFB split (for the CLI)."""
    bd = t.ttfb_breakdown()
    lines = [f"{'stage':<12}{'ms':>10}"]
    lines += [f"{k:<12}{v:>10.1f}" for k, v in bd.items()]
    lines.append(f"{'TTFB':<12}{t.ttfb * 1e3:>10.1f}")
    lines.append(f"chunks {len(t.chunks)}, audio {t.audio_seconds:.2f} s, RTF {t.rtf:.3f}, "
                 f"tokens/s {t.tokens_per_second:.1f}")
    return "\n".join(lines)
