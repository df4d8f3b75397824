"""Start-up: the graph plan (what each family captures, in which order) and the progress /health shows."""

from __future__ import annotations

import logging
import types

import pytest

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.graph_plan import (
    ENCODER_ROWS, FLOW_ROW_SIZES, PREFILL_TOKENS, STATE_FRAMES, PlanDims, decode_rows, encoder_token_buckets,
    first_chunk_frames, graph_plan, hift_jobs, incremental_bucket, incremental_shapes, kv_buckets, plan_counts,
    prefill_rows,
)
from cosyvoice_fast.config.schedule import final_vocoder_frames, vocoder_frames
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine import startup as su
from cosyvoice_fast.engine.startup import PHASES, StartupProgress
from cosyvoice_fast.kernels.compile_cache import open_compile_cache

GPU = BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", dtype="bf16")


# ------------------------------------------------------------------------------------------------ the plan
def test_the_default_plan_counts_per_family_and_totals():
    jobs = graph_plan([GPU], EngineConfig(), PlanDims(), llm_slots=64)
    assert plan_counts(jobs) == {"llm-decode": 28, "llm-prefill": 22, "flow-incremental": 18, "flow-encoder": 98,
                                 "flow-estimator": 88, "hift": 214}
    assert len(jobs) == 468 and sum(j.first_chunk for j in jobs) == 77
    assert len(set(jobs)) == len(jobs)  # no graph twice
    # the fused preset captures the same shapes (other kernels inside them)
    fused = BackendConfig(llm="fused", flow="fused", vocoder="fused", dtype="bf16")
    assert plan_counts(graph_plan([fused], EngineConfig(), llm_slots=64)) == plan_counts(jobs)


def test_first_chunk_shapes_come_first_in_every_family():
    jobs = graph_plan([GPU], EngineConfig(), PlanDims(), llm_slots=64)
    for family in plan_counts(jobs):
        flags = [j.first_chunk for j in jobs if j.family == family]
        assert flags == sorted(flags, reverse=True), family  # True ... True, False ... False
    hift = [j for j in jobs if j.family == "hift"]
    firsts = first_chunk_frames(StreamParams())
    assert firsts == tuple(range(50, 100, 2))  # 2 x (25 + prompt padding) for every prompt length mod 25
    # before ready: one row of every first-chunk length; then more rows, then the final-only lengths
    assert [j.shape for j in hift[:3]] == [(50, 1), (52, 1), (54, 1)]
    assert sum(j.first_chunk for j in hift) == 25 and [j.shape for j in hift[25:27]] == [(50, 2), (50, 4)]
    assert hift[-1].shape == (max(final_vocoder_frames(StreamParams())), 1)
    enc = [j.shape for j in jobs if j.family == "flow-encoder"]
    assert all(s[2] for s in enc[:49]) and not any(s[2] for s in enc[49:])  # streaming before full attention
    assert {s[1] for s in enc[:11]} == {1} and enc[11][1] == 2  # one request's rows first


def test_stages_shared_between_configs_are_counted_once_and_eager_stages_capture_nothing():
    engine = EngineConfig()
    one = graph_plan([GPU], engine, llm_slots=64)
    assert graph_plan([BackendConfig(), GPU, GPU], engine, llm_slots=64) == one
    mixed = BackendConfig(llm="cudagraph", flow="eager", vocoder="cudagraph", dtype="bf16")
    assert plan_counts(graph_plan([mixed], engine, llm_slots=64)) == {"llm-decode": 28, "llm-prefill": 22,
                                                                      "hift": 214}
    both = graph_plan([GPU, mixed], engine, llm_slots=64)
    assert len(both) == len(one)  # the mixed set's LLM and vocoder are the GPU set's
    recompute = BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", dtype="bf16",
                              incremental=False)
    assert "flow-incremental" not in plan_counts(graph_plan([recompute], engine, llm_slots=64))
    lazy = EngineConfig(capture_at_start=False)
    assert plan_counts(graph_plan([GPU], lazy, llm_slots=4)) == {"llm-decode": 12, "llm-prefill": 12}


def test_the_plan_follows_the_engine_config():
    small = EngineConfig(max_context=512, flow_buckets=(50, 100), flow_rows=(1, 2), vocoder_rows=(1,))
    counts = plan_counts(graph_plan([GPU], small, llm_slots=4))
    # decode: kv 256, 512 x rows 1, 2, 4; prefill 64..512 with rows within 4096 tokens and 4 slots
    assert counts["llm-decode"] == 6 and counts["llm-prefill"] == 3 + 3 + 3 + 3
    # (length, rows) within 2 x 100^2 row-frames: (50, 2), (50, 4), (100, 2); x 2 attention modes
    assert counts["flow-estimator"] == 2 * 3
    assert counts["flow-encoder"] == 2 * 2 * 2
    assert counts["hift"] == len(set(vocoder_frames(StreamParams())) | set(final_vocoder_frames(StreamParams())))


def test_plan_rules_are_the_runners_rules(tiny_models):
    from cosyvoice_fast.flow.graph import ROW_SIZES
    from cosyvoice_fast.flow.graph_encoder import ENCODER_ROWS as RUNNER_ENCODER_ROWS, token_buckets
    from cosyvoice_fast.flow.graph_incremental import DEFAULT_STATE_FRAMES, IncrementalEstimatorGraphs
    from cosyvoice_fast.llm.buckets import choose_kv_buckets, prefill_row_counts
    from cosyvoice_fast.llm.prefill import PREFILL_TOKENS as RUNNER_PREFILL_TOKENS

    assert FLOW_ROW_SIZES == ROW_SIZES and ENCODER_ROWS == RUNNER_ENCODER_ROWS
    assert PREFILL_TOKENS == RUNNER_PREFILL_TOKENS and STATE_FRAMES == DEFAULT_STATE_FRAMES
    for max_len in (64, 300, 512, 2048, 4096):
        assert kv_buckets(max_len) == choose_kv_buckets(max_len)
        for slots in (1, 3, 16, 64):
            for n in (64, 512):
                assert prefill_rows(slots, n) == prefill_row_counts(slots, n, PREFILL_TOKENS)
    assert decode_rows(64) == (1, 2, 4, 8, 16, 32, 64) and decode_rows(6) == (1, 2, 4, 6)
    buckets = EngineConfig().flow_buckets
    assert encoder_token_buckets(buckets, 2) == token_buckets(buckets, 2, 25, 1500)
    graphs = IncrementalEstimatorGraphs(tiny_models.flow, capture=False)
    assert graphs.shapes(400) == incremental_shapes(graphs.max_frames)
    assert incremental_shapes(1500) == [(50, 250), (50, 500), (50, 1000), (50, 1500), (100, 250), (100, 500),
                                        (100, 1000), (100, 1500), (200, 250), (200, 500), (200, 1000),
                                        (200, 1500), (300, 500), (300, 1000), (300, 1500), (400, 500),
                                        (400, 1000), (400, 1500)]


def test_incremental_calls_pad_to_a_handful_of_shapes():
    assert incremental_bucket(56, 0, 1500) == (100, 250)
    assert incremental_bucket(100, 150, 1500) == (100, 250)
    assert incremental_bucket(100, 151, 1500) == (100, 500)
    assert incremental_bucket(206, 0, 1500) == (300, 500)
    assert incremental_bucket(301, 0, 1500) == (400, 500)
    assert incremental_bucket(200, 1250, 1500) == (200, 1500)
    assert incremental_bucket(401, 0, 1500) is None  # longer than every bucket: the call runs eagerly
    assert incremental_bucket(206, 1206, 1500) == (206, 1500)  # 300 frames would run past the buffers
    shapes = set(incremental_shapes(1500))
    for start in range(0, 1300, 7):
        for n in (m for m in (1, 50, 56, 99, 108, 200, 206, 208) if start + m <= 1500):  # more: capacity error
            got = incremental_bucket(n, start, 1500)
            assert got[0] >= n and start + got[0] <= got[1] <= 1500, (n, start)
            assert got in shapes or got == (n, 1500), (n, start)  # near the buffers' end: exact, eager


def test_hift_jobs_match_the_schedule_lengths():
    jobs = hift_jobs((1, 2, 4, 8, 16), 16)
    streamed, finals = vocoder_frames(StreamParams()), final_vocoder_frames(StreamParams())
    assert len(streamed) == 27 and len(jobs) == 27 * 5 + len(set(finals) - set(streamed))
    assert {j.shape for j in jobs if j.shape[1] > 1} == {(n, r) for n in streamed for r in (2, 4, 8, 16)}
    assert hift_jobs((32,), 16) == []


# ------------------------------------------------------------------------------------------------ progress
class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _progress(clock: FakeClock, graphs: list[int]) -> StartupProgress:
    return StartupProgress(graphs=lambda: graphs[0], clock=clock, since_process_start=False)


def test_phases_run_in_order_and_log_one_line_each_with_seconds(caplog):
    clock, graphs = FakeClock(), [7]
    p = _progress(clock, graphs)
    assert p.snapshot()["phase"] == "loading weights" and p.snapshot()["status"] == "loading weights"
    with caplog.at_level(logging.INFO, logger=su.__name__):
        clock.t += 3.25
        p.plan(465)
        p.phase("capturing graphs")
        clock.t += 10
        graphs[0] += 120
        snap = p.snapshot()
        assert snap["status"] == "compiling kernels and capturing graphs 120/465"
        assert (snap["graphs_captured"], snap["graphs_planned"], snap["elapsed_s"]) == (120, 465, 13.25)
        p.phase("loading weights")  # never goes back
        assert p.snapshot()["phase"] == "capturing graphs"
        clock.t += 20
        graphs[0] += 345
        p.phase("warming up")
        clock.t += 1.5
        p.phase("ready")
    snap = p.snapshot()
    assert snap["phase"] == "ready" and p.ready and snap["status"] == "ready" and p.line() == ""
    assert snap["phases"] == [{"name": "loading weights", "seconds": 3.25}, {"name": "capturing graphs", "seconds": 30},
                              {"name": "warming up", "seconds": 1.5}]
    assert snap["elapsed_s"] == 34.75 and snap["estimate_s"] is None and snap["remaining_s"] is None
    clock.t += 100
    assert p.snapshot()["elapsed_s"] == 34.75  # the clock stops at ready
    assert [r.getMessage() for r in caplog.records] == [
        "start-up: loading weights took 3.2 s",
        "start-up: capturing graphs took 30.0 s (465 graphs, 0 kernels compiled)",
        "start-up: warming up took 1.5 s",
        "start-up: ready 34.8 s after the process started (loading weights 3.2 s, capturing graphs 30.0 s, "
        "warming up 1.5 s)"]
    assert [p["name"] for p in snap["phases"]] == list(PHASES[:-1])
    with pytest.raises(ValueError, match="unknown start-up phase 'compiling'; phases are loading weights, "
                                         "capturing graphs, warming up, ready"):
        p.phase("compiling")


def test_the_previous_start_in_the_cache_is_the_estimate_and_this_one_is_recorded(tmp_path):
    fields = {"gpu": "test"}
    cache = open_compile_cache(tmp_path, fields)
    cache.write_record("startup", {"total_s": 40.0})
    clock, graphs = FakeClock(), [0]
    p = _progress(clock, graphs)
    p.attach_cache(cache)
    (cache.triton_dir / "k1").mkdir(parents=True)  # a kernel compiled while starting
    clock.t += 12
    p.phase("capturing graphs")
    snap = p.snapshot()
    assert snap["estimate_s"] == 40.0 and snap["remaining_s"] == 28.0 and snap["kernels_compiled"] == 1
    assert snap["status"] == ("compiling kernels and capturing graphs 0/0 (1 kernels compiled), about 28 s left "
                              "(previous start: 40 s)")
    assert p.line() == "Starting up (12 s so far): " + snap["status"]
    clock.t += 50
    assert p.snapshot()["remaining_s"] == 0.0  # slower than last time: never negative
    p.phase("ready")
    rec = open_compile_cache(tmp_path, fields).read_record("startup")
    assert rec == {"total_s": 62.0, "graphs": 0, "kernels_compiled": 1,
                   "phases": {"loading weights": 12.0, "capturing graphs": 50.0}}


def test_a_failed_warm_up_is_shown_and_still_ends_ready():
    clock = FakeClock()
    p = _progress(clock, [0])
    p.fail("RuntimeError: boom")
    p.phase("ready")
    assert p.snapshot()["error"] == "RuntimeError: boom"
    assert p.line() == "Start-up warm-up failed (RuntimeError: boom); serving anyway."


def test_health_carries_the_startup_snapshot():
    import torch

    from cosyvoice_fast.serving.metrics import health

    clock = FakeClock()
    p = _progress(clock, [0])
    p.plan(10)
    p.phase("capturing graphs")
    stats = {"running": True, "stage_configs": [], "active": 0, "queued": 0}
    engine = types.SimpleNamespace(stats=lambda: stats, sample_rate=24000)
    models = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    service = types.SimpleNamespace(engine=engine, models=models, model_name="m", synthetic=True, frontend=None,
                                    warming=lambda: ["engine"], startup=p)
    h = health(service)
    assert h["ready"] is False and h["startup"]["phase"] == "capturing graphs"
    assert h["startup"]["status"] == "compiling kernels and capturing graphs 0/10"
    p.phase("warming up")
    assert health(service)["startup"]["phase"] == "warming up"
    p.phase("ready")
    service.warming = lambda: []
    h = health(service)
    assert h["ready"] is True and h["startup"]["phase"] == "ready"
    del service.startup
    assert health(service)["startup"] is None


def test_planned_graphs_count_cosyvoice2_runners_only():
    from dataclasses import replace

    from cosyvoice_fast.config.graph_plan import planned_graphs
    from cosyvoice_fast.config.model import full_config

    cfg = full_config()
    engine = EngineConfig(llm_slots=64, background_capture=True)
    assert planned_graphs([GPU], engine, cfg) == 77  # before ready; 391 more in the background after it
    assert planned_graphs([GPU], replace(engine, background_capture=False), cfg) == 468  # the default
    assert planned_graphs([GPU], engine, replace(cfg, family="cosyvoice3")) == 0  # unknown: N/N is shown
