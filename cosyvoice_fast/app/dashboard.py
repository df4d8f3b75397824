"""Plotly figures and tables of latency, built only from telemetry.

Every function here takes a :class:`~cosyvoice_fast.telemetry.record.RequestTelemetry` or its ``to_dict()`` form (times
in seconds relative to receipt) and nothing else, so what the app shows is exactly what the engine measured and
the same numbers the CLI and the benchmark print.  A request still streaming is fine: fields not yet written are
``None``/NaN and are simply not drawn.  Figures use milliseconds since the request was received.
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cosyvoice_fast.telemetry.record import STAGES, RequestTelemetry

TeleLike = RequestTelemetry | Mapping[str, Any]

# the three waits (app_queue, admission, queue) in hues told apart: mustard, brown, light grey
STAGE_COLORS = {"app_queue": "#e6ab02", "frontend": "#737373", "admission": "#8c6d31", "queue": "#cfcfcf",
                "llm_prefill": "#54278f", "llm_decode": "#9e9ac8", "flow": "#2b8cbe", "vocoder": "#31a354",
                "handoff": "#fd8d3c"}
STAGE_HELP = {"app_queue": "waiting in the server front end's queue (Gradio's, the HTTP API's) before the engine saw it",
              "frontend": "text normalisation, tokenisation, prompt features / speaker cache",
              "admission": "waiting in the engine's admission queue for a free slot",
              "queue": "waiting for the model worker (before prefill and before the first flow call)",
              "llm_prefill": "LM forward pass over prompt + text", "llm_decode": "LM sampling the first chunk's tokens",
              "flow": "flow matching: tokens to mel", "vocoder": "HiFT: mel to waveform",
              "handoff": "engine to caller (queue hand-over)"}
TIMELINE_PARTS = (("LLM tokens", "llm_decode"), ("queue", "queue"), ("flow", "flow"), ("vocoder", "vocoder"),
                  ("emission", "handoff"))
HEARD_COLOR = "#e7298a"
HEARD_HELP = ("click -> first sample played, measured by the page (network, the page's decoding and the audio "
              "output's latency on top of the server's TTFB)")
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
MODEBAR_PX = 34  # Plotly's toolbar sits in the top right corner of every figure: titles start below it
LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=48, b=40), font=dict(size=12),
               legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, traceorder="normal"))


def as_dict(t: TeleLike | None) -> dict[str, Any] | None:
    """The JSON form of a telemetry record (``to_dict()`` of an object, a plain copy of a mapping)."""
    if t is None:
        return None
    return t.to_dict() if isinstance(t, RequestTelemetry) else dict(t)


def as_number(x: Any) -> float:
    """A float, with None and non-numbers as NaN (unfinished fields of a live request)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def _fin(x: Any) -> bool:
    return math.isfinite(as_number(x))


def fmt_number(x: Any, digits: int = 1) -> str:
    """``x`` with ``digits`` decimals, or an en dash where it is not measured (yet)."""
    return f"{as_number(x):.{digits}f}" if _fin(x) else "–"


def empty_figure(message: str, height: int = 260) -> go.Figure:
    """A blank figure that says why it is blank (no run yet, run failed)."""
    fig = go.Figure()
    fig.add_annotation(text=html.escape(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14, color="#777"))
    fig.update_layout(**LAYOUT, height=height, xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


def breakdown_ms(t: TeleLike) -> dict[str, float]:
    """Stage -> ms of the TTFB split (NaN while the first chunk is not out yet)."""
    d = as_dict(t) or {}
    bd = (d.get("derived") or {}).get("ttfb_breakdown_ms") or {}
    return {s: as_number(bd.get(s)) for s in STAGES}


def ttfb_figure(runs: TeleLike | Sequence[TeleLike] | None, labels: Sequence[str] | None = None,
                title: str = "Time to first audio, by stage", x_range: Sequence[float] | None = None) -> go.Figure:
    """Horizontal stacked bar per run: one trace per stage (trace name = stage), values in ms, total at the end;
    under it, where the page played the run, a "heard at" bar (click -> first sample played)."""
    if runs is None:
        return empty_figure("Run a synthesis to see where the time to first audio goes.")
    runs = [runs] if isinstance(runs, (RequestTelemetry, Mapping)) else list(runs)
    dicts = [as_dict(r) or {} for r in runs]
    names = list(labels) if labels else [f"run {i + 1}" for i in range(len(dicts))] if len(dicts) > 1 else ["last"]
    bds = [breakdown_ms(d) for d in dicts]
    if not any(_fin(v) for bd in bds for v in bd.values()):
        return empty_figure("Waiting for the first audio chunk…")
    fig = go.Figure()
    for s in STAGES:
        vals = [bd[s] if _fin(bd[s]) else 0.0 for bd in bds]
        fig.add_trace(go.Bar(name=s, y=names, x=vals, orientation="h", marker_color=STAGE_COLORS[s],
                             customdata=[STAGE_HELP[s]] * len(vals),
                             hovertemplate=f"<b>{s}</b> %{{x:.1f}} ms<br>%{{customdata}}<extra>%{{y}}</extra>"))
    totals = [as_number((d.get("derived") or {}).get("ttfb_ms")) for d in dicts]
    rest = [t - sum(v for v in bd.values() if _fin(v)) if _fin(t) and not all(map(_fin, bd.values())) else 0.0
            for t, bd in zip(totals, bds)]
    if any(rest):  # a live record without the engine's early timestamps: show the unsplit remainder honestly
        fig.add_trace(go.Bar(name="not yet split", y=names, x=rest, orientation="h", marker_color="#eeeeee",
                             hovertemplate="<b>not yet split</b> %{x:.1f} ms<extra>%{y}</extra>"))
    for name, total, bd, r in zip(names, totals, bds, rest):
        if _fin(total):
            fig.add_annotation(x=sum(v for v in bd.values() if _fin(v)) + r, y=name, text=f" {total:.0f} ms",
                               showarrow=False, xanchor="left", font=dict(size=12))
    heard = [(f"{n} · heard", heard_ms(d)) for n, d in zip(names, dicts) if _fin(heard_ms(d))]
    if heard:  # the listener's figure, measured by the page: its own bar under the server's stages
        fig.add_trace(go.Bar(name="heard at", y=[h[0] for h in heard], x=[h[1] for h in heard], orientation="h",
                             marker_color=HEARD_COLOR, customdata=[HEARD_HELP] * len(heard),
                             hovertemplate="<b>heard at</b> %{x:.1f} ms<br>%{customdata}<extra>%{y}</extra>"))
        for y, ms in heard:
            fig.add_annotation(x=ms, y=y, text=f" {ms:.0f} ms", showarrow=False, xanchor="left", font=dict(size=12))
    heard_rows = {h[0] for h in heard}
    order = [y for n in names for y in (n, f"{n} · heard") if y == n or y in heard_rows]
    fig.update_layout(**_top_legend(LAYOUT), barmode="stack", height=190 + MODEBAR_PX + 40 * len(order),
                      title=dict(text=title, y=1.0, yref="container", yanchor="top", pad=dict(t=MODEBAR_PX)),
                      xaxis_title="ms: server stages since the request was received; heard at since the click",
                      yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=order))
    if x_range is not None:
        fig.update_xaxes(range=list(x_range))
    return fig


def heard_ms(t: TeleLike) -> float:
    """Click -> first sample played, as the page measured it (NaN when no page played this run)."""
    d = as_dict(t) or {}
    return as_number((d.get("client") or {}).get("heard_ms"))


def _top_legend(layout: Mapping[str, Any]) -> dict[str, Any]:
    """A horizontal legend between the title and the plot, with room for it (it wraps in half-width plots)."""
    return {**layout, "margin": dict(l=60, r=20, t=110 + MODEBAR_PX, b=40),
            "legend": dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0, traceorder="normal")}


def _chunk_spans(d: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per chunk: start/end (ms) of its LLM token window, queue wait, flow, vocoder and hand-over."""
    chunks = d.get("chunks") or []
    report = {r["index"]: r for r in (d.get("derived") or {}).get("chunks") or []}
    prev = as_number(d.get("prefill_start"))
    out = []

    def ms(a: float, b: float) -> tuple[float, float] | None:
        return (a * 1e3, b * 1e3) if _fin(a) and _fin(b) else None

    for c in chunks:
        ready, fs, fe, ve, dl = (as_number(c.get(k)) for k in ("tokens_ready", "flow_start", "flow_end",
                                                            "vocoder_end", "delivered"))
        r = report.get(c.get("index"), {})
        out.append({"label": f"chunk {c.get('index')}" + (f" (seg {c['segment']})" if c.get("segment") else ""),
                    "tokens": c.get("n_tokens"), "audio_s": as_number(c.get("n_samples")) / (c.get("sample_rate") or 1),
                    "LLM tokens": ms(prev, ready), "queue": ms(ready, fs), "flow": ms(fs, fe), "vocoder": ms(fe, ve),
                    "emission": ms(ve, dl), "deadline_ms": as_number(r.get("deadline_s")) * 1e3,
                    "ready_ms": dl * 1e3, "underrun": bool(r.get("underrun")), "slack_ms": as_number(r.get("slack_ms")),
                    "flow_mode": c.get("flow_mode") or "", "flow_frames": int(c.get("flow_frames") or 0),
                    "flow_state_bytes": int(c.get("flow_state_bytes") or 0)})
        prev = ready if _fin(ready) else prev
    return out


def _flow_note(span: Mapping[str, Any]) -> str:
    """Hover text of a flow bar: how the chunk's mel was made and how many frames the estimator ran."""
    if not span.get("flow_mode"):
        return ""
    frames = span.get("flow_frames") or 0
    note = f"{span['flow_mode']}: {frames} mel frames through the estimator"
    state = span.get("flow_state_bytes") or 0
    return note + (f"; state kept: {state / 2 ** 20:.1f} MiB" if state else "")


def chunk_timeline_figure(t: TeleLike | None, title: str = "Chunk timeline",
                          x_range: Sequence[float] | None = None) -> go.Figure:
    """One row per audio chunk: when its tokens were generated, waited, ran through flow and vocoder, and reached
    the caller, against the moment playback needs it (the deadline); late chunks (underruns) are marked red."""
    d = as_dict(t)
    if not d or not d.get("chunks"):
        return empty_figure("The chunk timeline appears with the first audio chunk." if d is None
                            else "Waiting for the first audio chunk…")
    spans = _chunk_spans(d)
    labels = [s["label"] for s in spans]
    fig = go.Figure()
    for part, stage in TIMELINE_PARTS:
        idx = [i for i, s in enumerate(spans) if s[part] is not None]
        if not idx:
            continue
        extra = ""
        if part == "flow":  # what the flow computed: the flat per-chunk cost of the incremental flow shows here
            extra = "<br>%{customdata[2]}"
        fig.add_trace(go.Bar(
            name=part, orientation="h", y=[labels[i] for i in idx], base=[spans[i][part][0] for i in idx],
            x=[spans[i][part][1] - spans[i][part][0] for i in idx], marker_color=STAGE_COLORS[stage],
            customdata=[[spans[i]["tokens"], spans[i][part][0], _flow_note(spans[i])] for i in idx],
            text=[f"{spans[i][part][1] - spans[i][part][0]:.0f}" for i in idx] if part == "flow" else None,
            textposition="inside" if part == "flow" else None,
            hovertemplate=(f"<b>{part}</b> %{{x:.1f}} ms (from %{{customdata[1]:.0f}} ms)"
                           f"<br>%{{customdata[0]}} tokens{extra}<extra>%{{y}}</extra>")))
    dl = [i for i, s in enumerate(spans) if _fin(s["deadline_ms"])]
    fig.add_trace(go.Scatter(
        name="playback deadline", mode="markers", y=[labels[i] for i in dl], x=[spans[i]["deadline_ms"] for i in dl],
        marker=dict(symbol="line-ns", size=22, line=dict(width=3, color="#222")),
        customdata=[[spans[i]["slack_ms"], spans[i]["audio_s"]] for i in dl],
        hovertemplate=("<b>playback needs it at</b> %{x:.0f} ms<br>slack %{customdata[0]:.0f} ms, "
                       "plays %{customdata[1]:.2f} s<extra>%{y}</extra>")))
    late = [i for i in dl if spans[i]["underrun"]]
    fig.add_trace(go.Scatter(
        name="underrun", mode="markers", y=[labels[i] for i in late], x=[spans[i]["ready_ms"] for i in late],
        marker=dict(symbol="x", size=14, color="#d62728", line=dict(width=2, color="#d62728")),
        customdata=[-spans[i]["slack_ms"] for i in late],
        hovertemplate="<b>underrun</b>: %{customdata:.0f} ms late (audible gap)<extra>%{y}</extra>"))
    labels = _text_marks(fig, d) + labels
    n_late = len(late)
    sub = f" · {n_late} underrun{'s' if n_late != 1 else ''}" if n_late else " · no underruns"
    flows = [s["flow"][1] - s["flow"][0] for s in spans if s["flow"] is not None]
    if flows:
        modes = sorted({s["flow_mode"] for s in spans if s["flow_mode"]})
        sub += f" · flow {min(flows):.0f}–{max(flows):.0f} ms/chunk" + (f" ({', '.join(modes)})" if modes else "")
    # the legend wraps onto several rows in a half-width plot (A/B tab): room for it between title and plot;
    # rows keep chunk order whichever stage first drew a chunk
    fig.update_layout(**_top_legend(LAYOUT), barmode="overlay", height=230 + MODEBAR_PX + 34 * len(labels),
                      title=dict(text=title + sub, y=1.0, yref="container", yanchor="top", pad=dict(t=MODEBAR_PX)),
                      xaxis_title="ms since the request was received",
                      yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=labels))
    if x_range is not None:
        fig.update_xaxes(range=list(x_range))
    return fig


TEXT_ROW = "text in"


def text_arrivals_ms(d: Mapping[str, Any]) -> list[float]:
    """Bi-streaming: when each text piece arrived (ms since the request was received)."""
    return [a * 1e3 for a in d.get("text_arrivals") or [] if _fin(a)]


def _text_marks(fig: go.Figure, d: Mapping[str, Any]) -> list[str]:
    """Bi-streaming: a row above the chunks marking each text piece's arrival and the 5th text token; returns
    the row's label (none for an ordinary request)."""
    arrivals = text_arrivals_ms(d)
    if not arrivals:
        return []
    fig.add_trace(go.Scatter(
        name="text piece arrived", mode="markers", y=[TEXT_ROW] * len(arrivals), x=arrivals,
        marker=dict(symbol="triangle-down", size=10, color="#9467bd"), customdata=list(range(1, len(arrivals) + 1)),
        hovertemplate="<b>text piece %{customdata}</b> arrived at %{x:.0f} ms<extra></extra>"))
    t5 = as_number(d.get("text_token5"))
    if _fin(t5):
        fig.add_trace(go.Scatter(
            name="5th text token", mode="markers", y=[TEXT_ROW], x=[t5 * 1e3],
            marker=dict(symbol="star", size=13, color="#ff7f0e"),
            hovertemplate="<b>5th text token</b> reached the LM at %{x:.0f} ms<extra></extra>"))
    return [TEXT_ROW]


def timeline_extent(*runs: TeleLike | None) -> tuple[float, float]:
    """One x range (ms) covering every chunk of ``runs``: A/B timelines drawn on it compare by eye."""
    end = 0.0
    for t in runs:
        d = as_dict(t)
        for s in _chunk_spans(d) if d else []:
            for part, _ in TIMELINE_PARTS:
                if s[part] is not None:
                    end = max(end, s[part][1])
            if _fin(s["deadline_ms"]):
                end = max(end, s["deadline_ms"])
        end = max([end] + (text_arrivals_ms(d) if d else []))
    return 0.0, end * 1.05 + 1.0


def run_label(params: Mapping[str, Any]) -> str:
    """'eager/eager/eager fp32': the backend triple and dtype a run used (colour key of the history chart)."""
    return f"{params.get('backend', '?')} {params.get('dtype', '')}".strip()


def history_record(t: TeleLike, run: int) -> dict[str, Any]:
    """A small JSON-ready record of one finished run, for the per-session history (gr.State)."""
    d = as_dict(t) or {}
    der = d.get("derived") or {}
    params = dict(d.get("params") or {})
    return {"run": run, "request_id": d.get("request_id"), "ttfb_ms": der.get("ttfb_ms"), "rtf": der.get("rtf"),
            "tokens_per_s": der.get("tokens_per_s"), "chunks": len(d.get("chunks") or []),
            "underruns": sum(bool(r.get("underrun")) for r in der.get("chunks") or []),
            "label": run_label(params), "params": params}


def history_figure(history: Sequence[Mapping[str, Any]]) -> go.Figure:
    """TTFB (top) and RTF (bottom) per run, one colour per backend/dtype; hover shows the run's parameters."""
    if not history:
        return empty_figure("Each run of this session is added here.", height=320)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("TTFB (ms)", "RTF (wall / audio; below 1 is faster than real time)"))
    labels = list(dict.fromkeys(h["label"] for h in history))
    for k, label in enumerate(labels):
        rows = [h for h in history if h["label"] == label]
        hover = ["<br>".join(f"{p}={v}" for p, v in h["params"].items() if p != "backend") for h in rows]
        color = RUN_COLORS[k % len(RUN_COLORS)]
        for row, key, unit in ((1, "ttfb_ms", "ms"), (2, "rtf", "")):
            fig.add_trace(go.Scatter(
                name=label, legendgroup=label, showlegend=row == 1, mode="markers+lines",
                x=[h["run"] for h in rows], y=[as_number(h[key]) for h in rows], customdata=hover,
                marker=dict(size=9, color=color), line=dict(color=color, width=1, dash="dot"),
                hovertemplate=f"run %{{x}}: %{{y:.3g}} {unit}<br>%{{customdata}}<extra>{html.escape(label)}</extra>"),
                row=row, col=1)
    fig.update_layout(**{**LAYOUT, "margin": dict(l=60, r=20, t=84 + MODEBAR_PX, b=40)}, height=400 + MODEBAR_PX,
                      title=dict(text="Run history (this session)", y=1.0, yref="container", yanchor="top",
                                 pad=dict(t=MODEBAR_PX)))
    # both from zero with headroom: one run alone gave a 926-927.5 ms axis and an RTF axis down to -0.5
    for row, key in ((1, "ttfb_ms"), (2, "rtf")):
        top = max((as_number(h[key]) for h in history if _fin(h[key])), default=math.nan)
        fig.update_yaxes(range=[0, top * 1.15] if _fin(top) and top > 0 else None, rangemode="nonnegative",
                         row=row, col=1)
    runs = [h["run"] for h in history]
    fig.update_xaxes(range=[min(runs) - 0.5, max(runs) + 0.5], dtick=1)
    fig.update_xaxes(title_text="run", row=2, col=1)
    return fig
