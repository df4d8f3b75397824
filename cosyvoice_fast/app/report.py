"""The benchmark's HTML report (``report.html`` beside ``results.json``): its table and figures, in the dashboard's
colours and layout so a benchmark and the app show the same stages the same way.  Kept apart from the live
dashboard: it reads a results dict of many runs, not one request's telemetry."""

from __future__ import annotations

import html
from typing import Any, Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from cosyvoice_fast.app.dashboard import LAYOUT, RUN_COLORS, STAGE_COLORS, as_number, empty_figure, fmt_number
from cosyvoice_fast.telemetry.record import STAGES

def _p(run: Mapping[str, Any], key: str, q: str = "p50") -> float:
    v = run.get(key)
    return as_number(v.get(q)) if isinstance(v, Mapping) else as_number(v)


def benchmark_figures(results: Mapping[str, Any]) -> list[go.Figure]:
    """Figures of a ``bench.py`` results dict: TTFB split per configuration, throughput and RTF vs concurrency,
    and per-step costs (LLM ms/token, flow and vocoder ms/chunk)."""
    runs = [r for r in results.get("runs", []) if "skipped" not in r]
    if not runs:
        return [empty_figure("No benchmark runs (every backend was skipped).")]
    names = [f"{r['backend']} ×{r['concurrency']}" for r in runs]
    split = go.Figure()
    for s in STAGES:
        split.add_trace(go.Bar(name=s, x=names, y=[_p(r, f"ttfb.{s}_ms") for r in runs], marker_color=STAGE_COLORS[s]))
    split.add_trace(go.Scatter(name="TTFB p95", x=names, y=[_p(r, "ttfb_ms", "p95") for r in runs], mode="markers",
                               marker=dict(symbol="diamond", size=10, color="#d62728")))
    split.update_layout(**LAYOUT, barmode="stack", height=420, yaxis_title="ms",
                        title="TTFB by stage (median of each stage) and TTFB p95, per backend × concurrency")
    scale = make_subplots(rows=1, cols=2, subplot_titles=("audio seconds per wall second", "RTF p50"))
    for k, b in enumerate(dict.fromkeys(r["backend"] for r in runs)):
        rs = sorted((r for r in runs if r["backend"] == b), key=lambda r: r["concurrency"])
        color = RUN_COLORS[k % len(RUN_COLORS)]
        for col, key in ((1, "audio_s_per_s"), (2, "rtf")):
            scale.add_trace(go.Scatter(name=b, legendgroup=b, showlegend=col == 1, x=[r["concurrency"] for r in rs],
                                       y=[_p(r, key) for r in rs], mode="lines+markers", line=dict(color=color)),
                            row=1, col=col)
    scale.update_layout(**LAYOUT, height=380, title="Scaling with concurrent requests")
    scale.update_xaxes(type="log", title_text="concurrent requests")
    steps = go.Figure()
    for key, label, color in (("llm_ms_per_token", "LLM ms / token", STAGE_COLORS["llm_decode"]),
                              ("flow_ms_per_chunk", "flow ms / chunk", STAGE_COLORS["flow"]),
                              ("vocoder_ms_per_chunk", "vocoder ms / chunk", STAGE_COLORS["vocoder"])):
        steps.add_trace(go.Bar(name=label, x=names, y=[_p(r, key) for r in runs], marker_color=color))
    steps.update_layout(**LAYOUT, barmode="group", height=380, yaxis_title="ms (p50)", title="Cost per step")
    return [split, scale, steps]


def benchmark_report_html(results: Mapping[str, Any], include_plotlyjs: bool | str = True) -> str:
    """A self-contained HTML page (Plotly inlined unless ``include_plotlyjs='cdn'``) of a benchmark run."""
    head = ", ".join(f"{k}: {html.escape(str(results.get(k)))}" for k in ("gpu", "dtype", "model", "torch"))
    rows = []
    for r in results.get("runs", []):
        if "skipped" in r:
            rows.append(f"<tr><td>{html.escape(str(r['backend']))}</td><td colspan=10>skipped: "
                        f"{html.escape(str(r['skipped']))}</td></tr>")
            continue
        cells = [r["backend"], r["concurrency"], fmt_number(_p(r, "ttfb_ms")), fmt_number(_p(r, "ttfb_ms", "p95")),
                 fmt_number(_p(r, "llm_ms_per_token"), 2), fmt_number(_p(r, "flow_ms_per_chunk")),
                 fmt_number(_p(r, "vocoder_ms_per_chunk")), fmt_number(_p(r, "rtf"), 3), fmt_number(_p(r, "audio_s_per_s"), 2),
                 r.get("underruns", "–"), fmt_number(_p(r, "gpu_mem_peak_gib"), 2)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    table = ("<table><tr><th>backend</th><th>concurrency</th><th>TTFB p50 ms</th><th>TTFB p95 ms</th>"
             "<th>LLM ms/token</th><th>flow ms/chunk</th><th>vocoder ms/chunk</th><th>RTF p50</th>"
             "<th>audio s/s</th><th>underruns</th><th>GPU mem peak GiB</th></tr>" + "".join(rows) + "</table>")
    figs = []
    for i, fig in enumerate(benchmark_figures(results)):
        figs.append(fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs if i == 0 else False))
    args = html.escape(str(results.get("args", {})))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>cosyvoice_fast benchmark</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:4px 8px;text-align:right}</style></head><body><h1>cosyvoice_fast benchmark</h1>"
            f"<p>{head}</p><p><small>{args}</small></p>{table}{''.join(figs)}</body></html>")
