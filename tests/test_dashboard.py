"""Dashboard figures carry exactly the telemetry's numbers: stage names and ms in the TTFB bar, per-chunk spans
and deadlines in the timeline, underruns marked, history coloured by backend, A/B differences."""

from __future__ import annotations

import json
import math

import pytest

plotly = pytest.importorskip("plotly", reason="plotly is not installed here (pip install -r requirements.txt)")
import plotly.graph_objects as go  # noqa: E402

from cosyvoice_fast.app import dashboard as db, tables  # noqa: E402
from cosyvoice_fast.app import report  # noqa: E402
from cosyvoice_fast.telemetry.record import STAGES, ChunkTiming, RequestTelemetry  # noqa: E402


def _tele(late_s: float = 0.5, backend: str = "eager/eager/eager", hop_first: int = 25) -> RequestTelemetry:
    """Two chunks; the second is delivered ``late_s`` after receipt (1.5 s makes it underrun)."""
    t = RequestTelemetry("r1", received=50.0)
    r = t.received
    t.frontend_done, t.prefill_start, t.prefill_done = r + 0.010, r + 0.012, r + 0.030
    t.token_times = [r + 0.030 + 0.01 * i for i in range(40)]
    t.chunks = [
        ChunkTiming(0, 0, 30, n_samples=24000, tokens_ready=r + 0.35, flow_start=r + 0.36, flow_end=r + 0.40,
                    vocoder_end=r + 0.41, delivered=r + 0.415),
        ChunkTiming(1, 0, 10, n_samples=12000, tokens_ready=r + 0.45, flow_start=r + 0.46,
                    flow_end=r + late_s - 0.02, vocoder_end=r + late_s - 0.01, delivered=r + late_s, finalize=True),
    ]
    t.finished = r + late_s
    t.params = {"backend": backend, "dtype": "fp32", "stream": True, "seed": 0, "token_hop_len_first": hop_first,
                "token_hop_len": 25, "stream_scale_factor": 2.0, "token_max_hop_len": 100, "pre_lookahead_len": 3}
    return t


def _trace(fig: go.Figure, name: str) -> go.BaseTraceType:
    found = [tr for tr in fig.data if tr.name == name]
    assert len(found) == 1, f"trace {name!r} not found in {[tr.name for tr in fig.data]}"
    return found[0]


@pytest.mark.parametrize("as_dict", [False, True])
def test_ttfb_figure_has_one_trace_per_stage_with_telemetry_values(as_dict):
    t = _tele()
    fig = db.ttfb_figure(t.to_dict() if as_dict else t)
    assert [tr.name for tr in fig.data] == list(STAGES)
    bd = t.ttfb_breakdown()
    for s in STAGES:
        assert _trace(fig, s).x[0] == pytest.approx(bd[s], abs=1e-9)
    total = sum(tr.x[0] for tr in fig.data)
    assert total == pytest.approx(t.ttfb * 1e3, abs=1e-6)  # 415 ms
    assert total == pytest.approx(415.0, abs=1e-6)
    assert _trace(fig, "llm_decode").x[0] == pytest.approx(320.0, abs=1e-6)
    assert any("415 ms" in a.text for a in fig.layout.annotations)
    json.loads(fig.to_json())  # serialisable for gr.Plot


def test_ttfb_figure_compares_runs_side_by_side():
    a, b = _tele(), _tele()
    b.chunks[0].flow_end -= 0.02  # B's flow is 20 ms faster
    fig = db.ttfb_figure([a, b], labels=["A", "B"])
    flow = _trace(fig, "flow")
    assert list(flow.y) == ["A", "B"]
    assert flow.x[0] - flow.x[1] == pytest.approx(20.0, abs=1e-6)


def test_timeline_spans_deadlines_and_no_underrun():
    t = _tele()
    fig = db.chunk_timeline_figure(t)
    flow, voc, llm = _trace(fig, "flow"), _trace(fig, "vocoder"), _trace(fig, "LLM tokens")
    rep = t.chunk_report()
    assert list(flow.x) == pytest.approx([r["flow_ms"] for r in rep], abs=1e-9)
    assert list(voc.x) == pytest.approx([r["vocoder_ms"] for r in rep], abs=1e-9)
    assert list(flow.base) == pytest.approx([360.0, 460.0], abs=1e-9)
    assert list(llm.base) == pytest.approx([12.0, 350.0], abs=1e-9)  # chunk 0 from prefill start
    dl = _trace(fig, "playback deadline")
    assert list(dl.x) == pytest.approx([r["deadline_s"] * 1e3 for r in rep], abs=1e-9)
    assert list(dl.x) == pytest.approx([415.0, 1415.0], abs=1e-9)
    assert len(_trace(fig, "underrun").x) == 0
    assert "no underruns" in fig.layout.title.text


def test_timeline_marks_underrun():
    t = _tele(late_s=1.5)  # needed at 1.415 s, delivered at 1.5 s
    fig = db.chunk_timeline_figure(t.to_dict())
    late = _trace(fig, "underrun")
    assert list(late.y) == ["chunk 1"]
    assert late.x[0] == pytest.approx(1500.0)
    assert late.customdata[0] == pytest.approx(85.0, abs=1e-6)
    assert "1 underrun" in fig.layout.title.text


def test_live_partial_telemetry_draws_what_exists():
    t = _tele()
    t.chunks = t.chunks[:1]
    t.finished = math.nan
    fig = db.chunk_timeline_figure(t)
    assert len(_trace(fig, "flow").x) == 1
    partial = RequestTelemetry("p", received=t.received)  # only the chunk timings known (app-side record)
    partial.chunks = t.chunks[:1]
    fig = db.ttfb_figure(partial)
    rest = _trace(fig, "not yet split").x[0]
    assert rest == pytest.approx(415.0 - 40.0 - 10.0 - 5.0, abs=1e-6)  # ttfb minus flow, vocoder, handoff
    assert _trace(fig, "frontend").x[0] == 0.0
    assert "not yet split" not in [tr.name for tr in db.ttfb_figure(t).data]
    waiting = RequestTelemetry("w")
    assert "Waiting" in db.ttfb_figure(waiting).layout.annotations[0].text
    assert "Waiting" in db.chunk_timeline_figure(waiting).layout.annotations[0].text
    assert db.ttfb_figure(None).data == ()


def test_history_colours_by_backend_and_hover_has_params():
    runs = [_tele(), _tele(backend="cudagraph/eager/eager"), _tele(hop_first=10)]
    hist = [db.history_record(t, i + 1) for i, t in enumerate(runs)]
    assert hist[0]["ttfb_ms"] == pytest.approx(415.0)
    assert hist[0]["label"] == "eager/eager/eager fp32"
    json.dumps(hist)
    fig = db.history_figure(hist)
    ttfb = [tr for tr in fig.data if tr.yaxis in (None, "y") and tr.showlegend]
    assert sorted(tr.name for tr in ttfb) == ["cudagraph/eager/eager fp32", "eager/eager/eager fp32"]
    eager = [tr for tr in ttfb if tr.name.startswith("eager")][0]
    assert list(eager.x) == [1, 3]
    assert "token_hop_len_first=10" in eager.customdata[1]
    rtf = [tr for tr in fig.data if tr.yaxis == "y2"]
    assert sum(len(tr.y) for tr in rtf) == 3
    assert rtf[0].y[0] == pytest.approx(runs[0].rtf)


def test_summary_rows():
    t = _tele()
    rows = {r[0]: r[1] for r in tables.summary_rows(t)}
    assert rows["TTFB"] == pytest.approx(415.0)
    assert rows["RTF"] == pytest.approx(round(0.5 / 1.5, 3))
    assert rows["chunks"] == 2
    assert rows["tokens/s"] == pytest.approx(100.0, abs=0.05)
    assert rows["audio"] == pytest.approx(1.5)
    assert rows["underruns"] == 0
    assert tables.summary_rows(None) == []


def test_ab_difference_rows():
    a, b = _tele(), _tele(late_s=1.5)
    b.chunks[0].flow_end -= 0.02
    rows = {r[0]: r[1:] for r in tables.ab_difference_rows(a, b.to_dict())}
    assert rows["TTFB (ms)"][:2] == [pytest.approx(415.0), pytest.approx(415.0)]
    assert rows["  flow (ms)"][2] == pytest.approx(-20.0, abs=1e-6)
    assert rows["  flow (ms)"][3] == pytest.approx(0.5)
    assert rows["underruns"][:3] == [0, 1, 1]
    assert [r[0] for r in tables.ab_difference_rows(a, b)][1:1 + len(STAGES)] == [f"  {s} (ms)" for s in STAGES]


def test_benchmark_report_html_lists_runs_and_skips():
    agg = {"ttfb_ms": {"p50": 120.0, "p95": 180.0}, "rtf": {"p50": 0.2}, "llm_ms_per_token": {"p50": 9.5},
           "flow_ms_per_chunk": {"p50": 30.0}, "vocoder_ms_per_chunk": {"p50": 5.0}, "audio_s_per_s": 4.0,
           **{f"ttfb.{s}_ms": {"p50": 10.0} for s in STAGES}}
    results = {"gpu": "H100", "dtype": "bf16", "model": "synthetic-full", "torch": "x", "args": {},
               "runs": [{"backend": "eager", "concurrency": 1, **agg}, {"backend": "eager", "concurrency": 4, **agg},
                        {"backend": "tensorrt", "skipped": "flow:tensorrt (needs a CUDA GPU)"}]}
    page = report.benchmark_report_html(results, include_plotlyjs="cdn")
    assert "skipped: flow:tensorrt" in page and "<td>120.0</td>" in page
    figs = report.benchmark_figures(results)
    assert [tr.name for tr in figs[0].data][:len(STAGES)] == list(STAGES)
    assert list(figs[0].data[-1].y) == [180.0, 180.0]


def _bench_results() -> dict:
    """A results dict built the way ``bench.py`` builds it: ``aggregate()`` of fabricated telemetry plus the
    extra keys ``bench_config`` adds, two backends × two concurrencies and one skipped backend."""
    from cosyvoice_fast.telemetry.record import aggregate

    runs = []
    for backend, late in (("eager", 0.5), ("cudagraph", 0.45)):
        for c in (1, 4):
            teles = [_tele(late_s=late, backend=backend) for _ in range(3)]
            agg = aggregate(teles)
            agg.update(llm_ms_per_token={"p50": 10.0 / c, "p95": 12.0 / c}, audio_s_per_s=1.5 * c, wall_s=2.0,
                       gpu_mem_peak_gib=None, underruns=0)
            runs.append({"backend": backend, "concurrency": c, **agg})
    runs.append({"backend": "tensorrt", "skipped": "flow:tensorrt (needs a CUDA GPU)"})
    return {"gpu": "cpu", "dtype": "fp32", "model": "synthetic-tiny", "torch": "2.x",
            "args": {"requests": 3, "gen_tokens": 40}, "runs": runs}


def test_benchmark_report_html_renders_bench_results():
    results = _bench_results()
    page = report.benchmark_report_html(results, include_plotlyjs="cdn")
    assert page.startswith("<!doctype html>") and page.count("Plotly.newPlot") == 3
    for name in (*STAGES, "TTFB p95", "eager", "cudagraph", "LLM ms / token", "flow ms / chunk",
                 "vocoder ms / chunk"):
        # every trace is in the embedded figure JSON (plotly writes "/" as \u002f there)
        assert '"name":"%s"' % name.replace("/", "\\u002f") in page, name
    assert "skipped: flow:tensorrt (needs a CUDA GPU)" in page
    assert "<td>415.0</td>" in page  # TTFB p50 of the fabricated runs
    figs = report.benchmark_figures(results)
    split = {tr.name: tr for tr in figs[0].data}
    assert list(split["flow"].x) == ["eager ×1", "eager ×4", "cudagraph ×1", "cudagraph ×4"]
    assert list(split["flow"].y) == pytest.approx([40.0] * 4)
    scale = [tr for tr in figs[1].data if tr.name == "cudagraph" and tr.xaxis in (None, "x")][0]
    assert list(scale.y) == pytest.approx([1.5, 6.0])
    json.loads(figs[2].to_json())
    # the inlined default is self-contained (no network needed to open the report)
    inlined = report.benchmark_report_html(results)
    assert '<script src="https://cdn.plot.ly' not in inlined and len(inlined) > 1_000_000


def test_benchmark_report_html_survives_json_round_trip_and_all_skipped():
    results = json.loads(json.dumps(_bench_results()).replace("NaN", "null"))  # results.json form
    assert "eager" in report.benchmark_report_html(results, include_plotlyjs="cdn")
    page = report.benchmark_report_html({"runs": [{"backend": "tensorrt", "skipped": "no GPU"}]}, include_plotlyjs="cdn")
    assert "skipped: no GPU" in page and "every backend was skipped" in page


def test_timeline_shows_what_the_flow_computed_per_chunk():
    """The flow bars carry their ms as text and the flow mode / estimator frames on hover; the title gives the
    per-chunk flow range (flat for the incremental flow)."""
    t = _tele()
    t.chunks[0].flow_mode, t.chunks[0].flow_frames, t.chunks[0].flow_state_bytes = "incremental", 100, 3 * 2 ** 20
    t.chunks[1].flow_mode, t.chunks[1].flow_frames = "recompute", 240
    fig = db.chunk_timeline_figure(t.to_dict())
    flow = _trace(fig, "flow")
    assert list(flow.text) == ["40", "20"]  # 360-400 ms and 460-480 ms
    assert [c[2] for c in flow.customdata] == ["incremental: 100 mel frames through the estimator; state kept: 3.0 MiB",
                                               "recompute: 240 mel frames through the estimator"]
    assert "flow 20–40 ms/chunk (incremental, recompute)" in fig.layout.title.text
    assert _trace(db.chunk_timeline_figure(_tele()), "flow").customdata[0][2] == ""  # older telemetry: no note


def test_the_three_waits_have_colours_told_apart():
    def rgb(h: str) -> tuple[int, ...]:
        return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))

    waits = [rgb(db.STAGE_COLORS[s]) for s in ("app_queue", "admission", "queue")]
    for i in range(3):
        for j in range(i + 1, 3):  # near-identical greys were 10-30 apart on every channel
            assert sum(abs(x - y) for x, y in zip(waits[i], waits[j])) > 90, (waits[i], waits[j])
    assert len(set(db.STAGE_COLORS.values())) == len(db.STAGE_COLORS)


def test_titles_sit_below_the_plotly_toolbar():
    t = _tele()
    for fig in (db.ttfb_figure(t), db.chunk_timeline_figure(t, "A"), db.history_figure([db.history_record(t, 1)])):
        assert fig.layout.title.pad.t >= db.MODEBAR_PX and fig.layout.margin.t > db.MODEBAR_PX + 40


def test_one_run_history_has_sane_axes():
    fig = db.history_figure([db.history_record(_tele(), 1)])
    assert tuple(fig.layout.yaxis.range) == pytest.approx((0.0, 415.0 * 1.15))  # not 414.5-415.5
    assert fig.layout.yaxis2.range[0] == 0 and fig.layout.yaxis2.range[1] > _tele().rtf  # no negative RTF
    assert tuple(fig.layout.xaxis2.range) == (0.5, 1.5)


def test_summary_shows_the_first_chunk_size_the_engine_used():
    padded = _tele(hop_first=25)  # its first chunk has 30 tokens: 25 padded with the prompt
    assert tables.first_chunk_row(padded.to_dict()) == [
        "first chunk", 30, "tokens (25 asked, padded to fill whole 25-token chunks)"]
    asked = _tele(hop_first=30)
    assert tables.first_chunk_row(asked.to_dict()) == ["first chunk", 30, "tokens (as asked)"]
    rows = [r[0] for r in tables.summary_rows(padded)]
    assert rows.index("first chunk") == rows.index("chunks") + 1
    assert all(len(str(r[2])) <= 60 for r in tables.summary_rows(padded))  # the unit column is read, not clipped


def test_ab_rows_are_rounded_to_a_tenth_of_a_millisecond():
    a, b = _tele(), _tele(late_s=1.5)
    b.chunks[0].flow_end -= 0.0123456
    rows = {r[0]: r[1:] for r in tables.ab_difference_rows(a, b)}
    assert rows["  flow (ms)"][1] == 27.7 and rows["  flow (ms)"][2] == -12.3
    assert rows["RTF"][0] == round(a.rtf, 3)


def test_stopped_status_says_what_was_heard():
    t = _tele().to_dict()
    assert tables.status_line(t, "cancelled").startswith(
        "stopped: 1.50 s of audio made in 2 chunks before Stop, TTFB 415 ms")  # no page: nothing heard known
    t["client"] = {"stop_heard_s": 0.42, "heard_ms": 480.0}
    assert tables.status_line(t, "cancelled") == ("stopped after 0.42 s heard (1.50 s of audio made in 2 chunks "
                                                   "before Stop), TTFB 415 ms, heard at 480 ms")
