"""Telemetry: the TTFB split sums to the TTFB, chunk deadlines and underruns, aggregation, JSON."""

from __future__ import annotations

import json
import math

from cosyvoice_fast.telemetry.record import STAGES, ChunkTiming, RequestTelemetry, aggregate, percentile


def _req(offset: float = 0.0, slow_second: bool = False) -> RequestTelemetry:
    t = RequestTelemetry("r", received=100.0 + offset)
    t.frontend_done = t.received + 0.010
    t.prefill_start = t.received + 0.012
    t.prefill_done = t.received + 0.030
    t.token_times = [t.received + 0.030 + 0.01 * i for i in range(40)]
    c0 = ChunkTiming(0, 0, 30, n_samples=24000, tokens_ready=t.received + 0.35, flow_start=t.received + 0.36,
                     flow_end=t.received + 0.40, vocoder_end=t.received + 0.41, delivered=t.received + 0.415)
    late = 1.5 if slow_second else 0.5
    c1 = ChunkTiming(1, 0, 10, n_samples=12000, tokens_ready=t.received + 0.45, flow_start=t.received + 0.46,
                     flow_end=t.received + late - 0.02, vocoder_end=t.received + late - 0.01,
                     delivered=t.received + late, finalize=True)
    t.chunks = [c0, c1]
    t.finished = c1.delivered
    return t


def test_breakdown_sums_to_ttfb_and_is_ordered():
    t = _req()
    bd = t.ttfb_breakdown()
    assert list(bd) == list(STAGES)
    assert all(v >= 0 for v in bd.values())
    assert math.isclose(sum(bd.values()), t.ttfb * 1e3, rel_tol=1e-9)
    assert math.isclose(bd["queue"], (0.002 + 0.01) * 1e3, rel_tol=1e-6)
    assert math.isclose(bd["flow"], 40.0, rel_tol=1e-6)


def test_chunk_deadlines_and_underrun():
    ok = _req().chunk_report()
    assert [r["underrun"] for r in ok] == [False, False]
    late = _req(slow_second=True).chunk_report()
    # chunk 1 is needed 1.0 s (24000 samples) after chunk 0 was delivered at 0.415 s, arrives at 1.5 s
    assert late[1]["underrun"] is True
    assert math.isclose(late[1]["deadline_s"], 1.415, rel_tol=1e-9)
    assert math.isclose(late[1]["slack_ms"], -85.0, rel_tol=1e-6)


def test_rtf_and_tokens_per_second():
    t = _req()
    assert math.isclose(t.audio_seconds, 1.5)
    assert math.isclose(t.rtf, 0.5 / 1.5)
    assert math.isclose(t.tokens_per_second, 100.0, rel_tol=1e-6)


def test_to_dict_is_json_and_relative():
    d = json.loads(json.dumps(_req().to_dict()))
    assert d["received"] == 0.0
    assert math.isclose(d["chunks"][0]["delivered"], 0.415, rel_tol=1e-6)
    assert math.isclose(d["derived"]["ttfb_ms"], 415.0, rel_tol=1e-6)


def test_aggregate_percentiles():
    reqs = [_req(offset=i) for i in range(10)]
    agg = aggregate(reqs)
    assert agg["n"] == 10
    assert math.isclose(agg["ttfb_ms"]["p50"], 415.0, rel_tol=1e-6)
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert math.isclose(percentile(range(1, 101), 95), 95.05)
    assert math.isnan(percentile([], 50))


def test_bench_splits_the_queue_stage_into_its_llm_and_chunk_parts():
    from cosyvoice_fast.bench.engine_bench import queue_parts

    reqs = [_req(), _req(offset=5.0)]
    reqs[1].admitted = reqs[1].frontend_done + 0.001  # waited 1 ms for admission: not part of the queue
    parts = queue_parts(reqs)
    assert math.isclose(parts["queue_llm_ms"]["p50"], 1.5, rel_tol=1e-6)  # 2 ms and 1 ms
    assert math.isclose(parts["queue_chunk_ms"]["p50"], 10.0, rel_tol=1e-6)
    for r in reqs:
        assert math.isclose(r.ttfb_breakdown()["queue"], sum(p["p50"] for p in
                                                            queue_parts([r]).values()), rel_tol=1e-6)
