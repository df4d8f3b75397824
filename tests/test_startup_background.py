"""Ready for first chunks, the rest captured behind it: which graphs come before ready and which after (the plan
and the runners agree), the background capture thread (order, publishing, a failed capture, the counters that
say which thread captured), and what /health and the page say meanwhile."""

from __future__ import annotations

import logging
import threading
import types

import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.graph_plan import (
    PlanDims, first_chunk_frames, graph_plan, hift_jobs, plan_counts, planned_graphs, split_ready, stage_jobs,
)
from cosyvoice_fast.config.schedule import final_vocoder_frames, vocoder_frames
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.startup import StartupProgress
from cosyvoice_fast.kernels import graphs
from cosyvoice_fast.kernels.graphs import BackgroundCaptures, DeferredCapture

GPU = BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", dtype="bf16")
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------ the split
BG = EngineConfig(background_capture=True)


def test_the_default_plan_splits_into_first_chunk_graphs_before_ready_and_the_rest_after():
    before, after = split_ready(graph_plan([GPU], BG, PlanDims(), llm_slots=64), BG)
    assert plan_counts(before) == {"llm-decode": 4, "llm-prefill": 8, "flow-incremental": 18, "flow-encoder": 11,
                                   "flow-estimator": 11, "hift": 25}
    assert plan_counts(after) == {"llm-decode": 24, "llm-prefill": 14, "flow-estimator": 77, "flow-encoder": 87,
                                  "hift": 189}
    assert len(before) == 77 and len(after) == 391
    assert all(j.first_chunk for j in before) and not any(j.first_chunk for j in after)
    # the LLM: 1 and all rows at the smallest and largest KV bucket, 1 and the most rows per prefill length
    assert [j.shape for j in before if j.family == "llm-decode"] == [(256, 1), (256, 64), (2048, 1), (2048, 64)]
    assert [j.shape for j in before if j.family == "llm-prefill"] == [
        (64, 1), (64, 64), (128, 1), (128, 32), (256, 1), (256, 16), (512, 1), (512, 8)]
    # the flow: streaming graphs of one request (2 CFG rows; 1 encoder row) at every length
    est = [j.shape for j in before if j.family == "flow-estimator"]
    assert est == [(f, True, 2) for f in EngineConfig().flow_buckets]
    assert [j.shape for j in before if j.family == "flow-encoder"] == [
        (b, 1, True) for b in (25, 50, 75, 100, 125, 150, 200, 250, 375, 500, 750)]
    # HiFT: one row of every first-chunk length; more rows and the later lengths after ready
    firsts = set(first_chunk_frames(StreamParams()))
    assert sorted(j.shape for j in before if j.family == "hift") == [(n, 1) for n in sorted(firsts)]
    assert {j.shape[1] for j in after if j.family == "hift" and j.shape[0] in firsts} == {2, 4, 8, 16}


def test_capture_all_before_ready_or_capture_on_first_use_leaves_nothing_for_the_background():
    jobs = graph_plan([GPU], EngineConfig(), PlanDims(), llm_slots=64)
    before, after = split_ready(jobs, EngineConfig(background_capture=False))
    assert before == jobs and after == []
    assert split_ready(jobs, EngineConfig()) == (jobs, [])  # the default: every graph before ready
    lazy = EngineConfig(capture_at_start=False)
    assert split_ready(graph_plan([GPU], lazy, llm_slots=4), lazy)[1] == []


def test_planned_graphs_counts_only_those_before_ready():
    model = types.SimpleNamespace(family="cosyvoice2", chunk_size=25, token_mel_ratio=2,
                                  flow=types.SimpleNamespace(encoder=types.SimpleNamespace(upsample_stride=2)))
    engine = EngineConfig(llm_slots=64, background_capture=True)
    assert planned_graphs([GPU], engine, model) == 77
    assert planned_graphs([GPU], EngineConfig(llm_slots=64), model) == 468  # the default: all before ready


def test_background_capture_is_off_unless_its_flag_turns_it_on():
    """Off by default: on an H100 a background capture beside the start-up's GPU work was invalidated and its pool
    then refused the family's other captures (docs/architecture.md, Start-up)."""
    import argparse

    from cosyvoice_fast.config.flags import add_cli_args

    p = argparse.ArgumentParser()
    add_cli_args(p, parts=("engine",))
    assert p.parse_args(["--background-capture"]).background_capture is True
    assert p.parse_args([]).background_capture is None  # not given: EngineConfig's default (off)
    assert EngineConfig().background_capture is False
    with pytest.raises(SystemExit):
        p.parse_args(["--capture-all-before-ready"])  # the alias of the old default-on switch is gone
    with pytest.raises(ValueError, match="EngineConfig.background_capture must be True or False"):
        EngineConfig(background_capture="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the runners
def test_the_flow_runner_captures_the_plans_first_chunk_graphs_and_defers_the_rest(tiny_models, fake_graphs):
    from cosyvoice_fast.flow.graph import CudaGraphFlow, GraphEstimator
    from cosyvoice_fast.flow.graph_capture import capture_flow
    from cosyvoice_fast.flow.graph_encoder import GraphEncoder

    engine = EngineConfig(flow_buckets=(50, 100, 150), flow_rows=(1, 2), background_capture=True)
    flow = tiny_models.flow
    stage = CudaGraphFlow.__new__(CudaGraphFlow)  # __init__ refuses without CUDA
    stage.flow, stage.incremental, stage.deferred = flow, None, []
    cfm = flow.cfg.cfm
    stage.estimator = GraphEstimator(flow.decoder.estimator, torch.device("cpu"), buckets=engine.flow_buckets,
                                     solver=(cfm.inference_cfg_rate, cfm.n_timesteps))
    stage.encoder = GraphEncoder(flow, torch.device("cpu"), engine.flow_buckets, rows=(1, 2))
    n = capture_flow(stage, engine.flow_rows, progress=False, defer=True)
    before, after = split_ready(stage_jobs("flow", "cudagraph", engine, PlanDims(), incremental=False), engine)
    assert n == len(before) and len(stage.deferred) == len(after) > 0
    assert [(d.family, d.shape) for d in stage.deferred] == [(j.family, j.shape) for j in after]
    steps = stage.estimator.steps.caches
    assert {k[:2] for k in steps[True].graphs} == {j.shape[::2] for j in before if j.family == "flow-estimator"}
    assert not steps[False].graphs and not stage.encoder.caches[False].graphs
    assert all(c.frozen for c in [*steps.values(), *stage.encoder.caches.values()])
    worker = BackgroundCaptures()
    worker.add(stage.deferred)
    assert worker.join(60) and worker.done == len(after) and worker.failed == 0
    assert {k[:2] for k in steps[False].graphs} == {j.shape[::2] for j in after if j.family == "flow-estimator"}
    assert {k[:2] for k in stage.encoder.caches[False].graphs} == \
        {j.shape[:2] for j in after if j.family == "flow-encoder"}


def test_the_vocoder_captures_first_chunk_lengths_and_defers_the_rest(tiny_models, monkeypatch):
    import copy

    from cosyvoice_fast.vocoder import graph as vgraph

    def fake_capture(fn, device, pool, warmup=1):  # noqa: ANN001 - stands in for the CUDA capture: runs nothing
        graphs.count_capture()
        return types.SimpleNamespace(replay=fn), ()

    monkeypatch.setattr(vgraph, "why_unavailable_on", lambda dev: None)
    monkeypatch.setattr(vgraph, "capture", fake_capture)
    from conftest import _FakeGraphCache

    monkeypatch.setattr(vgraph, "GraphCache", _FakeGraphCache)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    params = StreamParams()
    firsts = first_chunk_frames(params)
    rows = (1, 2, 4)
    before_fg, before_bg = graphs.captures(), graphs.background_captures()
    voc = vgraph.CudaGraphVocoder(copy.deepcopy(tiny_models.hift), rows=rows, lengths=vocoder_frames(params),
                                  final_lengths=final_vocoder_frames(params), progress=False, defer_after=firsts)
    plan_before, plan_after = split_ready(hift_jobs(rows, 4), BG)
    assert sorted(voc.batch_graphs) == sorted(j.shape for j in plan_before)
    assert [d.shape for d in voc.deferred] == [j.shape for j in plan_after]
    assert graphs.captures() - before_fg == len(plan_before)
    later = plan_after[0].shape
    assert voc._graph_for(later[1], later[0]) is None  # a later length: the eager path until its graph is in
    assert voc.graphs.frozen  # ... whose one-row filter graph is never captured on a request's thread either
    assert voc._graph_for(1, firsts[0]) is voc.batch_graphs[firsts[0], 1]
    four = next(d for d in voc.deferred if d.shape == (firsts[0], 4))
    first = BackgroundCaptures(device="cpu")  # a bigger row count lands first: 2 rows pad up to it meanwhile
    first.add([four])
    assert first.join(60) and first.done == 1
    assert voc._graph_for(2, firsts[0]) is voc._graph_for(3, firsts[0]) is voc.batch_graphs[firsts[0], 4]
    worker = BackgroundCaptures(device="cpu")
    worker.add(voc.deferred)
    assert worker.join(120) and worker.failed == 0
    assert sorted(voc.batch_graphs) == sorted(j.shape for j in plan_before + plan_after)
    assert voc._graph_for(later[1], later[0]) is not None
    # the background thread's captures are counted apart: none of them on this (a request's) thread
    assert graphs.captures() - before_fg == len(plan_before)
    assert graphs.background_captures() - before_bg == len(plan_after) + 1  # (50, 4) twice


# ------------------------------------------------------------------------------------------------ the thread
def _job(name: str, log: list[str], fail: bool = False) -> DeferredCapture:
    def capture() -> str:
        log.append(f"{name}@{threading.current_thread().name}")
        if fail:
            raise RuntimeError(f"{name} ran out of shared memory")
        graphs.count_capture()
        return f"graph {name}"

    return DeferredCapture("hift", (name,), capture, lambda graph: log.append(f"published {graph}"))


def test_background_jobs_run_in_order_on_one_thread_and_are_counted_as_background():
    ran: list[str] = []
    done: list[tuple[float, int, int]] = []
    fg, bg = graphs.captures(), graphs.background_captures()
    worker = BackgroundCaptures(on_done=lambda s, n, f: done.append((s, n, f)))
    assert worker.finished and worker.total == 0
    worker.add([_job(c, ran) for c in "abcd"])
    assert worker.join(30)
    assert ran == [x for c in "abcd" for x in (f"{c}@cosyvoice-capture", f"published graph {c}")]
    assert (worker.done, worker.failed, worker.total) == (4, 0, 4) and worker.seconds is not None
    assert len(done) == 1 and done[0][1:] == (4, 0)
    assert graphs.captures() == fg and graphs.background_captures() == bg + 4
    assert graphs.all_captures() == fg + bg + 4
    worker.add([_job("e", ran)])  # a stage built later: its jobs run behind, on the same kind of thread
    assert worker.join(30) and ran[-2:] == ["e@cosyvoice-capture", "published graph e"]
    assert worker.total == 5 and len(done) == 2


def test_a_failed_background_capture_logs_a_warning_leaves_that_shape_eager_and_the_rest_go_on(caplog):
    ran: list[str] = []
    worker = BackgroundCaptures()
    with caplog.at_level(logging.WARNING, logger="cosyvoice_fast.kernels.graphs"):
        worker.add([_job("a", ran), _job("b", ran, fail=True), _job("c", ran)])
        assert worker.join(30)
    assert ran == ["a@cosyvoice-capture", "published graph a", "b@cosyvoice-capture", "c@cosyvoice-capture",
                   "published graph c"]  # b's shape: nothing published, it stays eager
    assert (worker.done, worker.failed) == (2, 1)
    assert worker.errors == ["hift ('b',): RuntimeError: b ran out of shared memory"]
    assert any("background graph capture failed (hift ('b',): RuntimeError: b ran out of shared memory); that "
               "shape keeps running eagerly" in r.getMessage() for r in caplog.records)


def test_a_stopped_worker_runs_nothing_more():
    ran: list[str] = []
    gate = threading.Event()
    worker = BackgroundCaptures()
    worker.add([DeferredCapture("hift", ("wait",), lambda: gate.wait(10)), _job("x", ran)])
    worker.stop()
    gate.set()
    assert worker.join(30) and ran == [] and worker.done == 1
    worker.add([_job("y", ran)])  # after stop: ignored
    assert worker.join(5) and ran == []


def test_background_captures_wait_for_a_stage_build():
    """A stage build holds CAPTURE_LOCK: a background capture never overlaps it (nor its device syncs)."""
    ran: list[str] = []
    worker = BackgroundCaptures()
    with graphs.CAPTURE_LOCK:
        worker.add([_job("a", ran)])
        assert not worker.join(0.3) and ran == []
    assert worker.join(30) and len(ran) == 2


def test_a_graph_is_published_after_the_capture_lock_is_released():
    """A request thread may hold its runner's lock and wait for nothing else: publishing (which takes the
    runner's lock) never happens while the worker holds CAPTURE_LOCK, so the two cannot deadlock."""
    owned: list[bool] = []

    def capture() -> str:
        owned.append(graphs.CAPTURE_LOCK._is_owned())
        return "g"

    worker = BackgroundCaptures()
    worker.add([DeferredCapture("hift", (1,), capture, lambda g: owned.append(graphs.CAPTURE_LOCK._is_owned()))])
    assert worker.join(30) and worker.done == 1
    assert owned == [True, False]  # captured holding it, published without it


def test_the_stage_cache_hands_over_each_built_runners_deferred_captures_once(monkeypatch):
    from cosyvoice_fast.engine import stages

    jobs = {name: [DeferredCapture("hift", (name, i), lambda: None) for i in range(2)] for name in ("f", "v")}
    monkeypatch.setattr(stages, "_build_llm", lambda *a: types.SimpleNamespace())
    monkeypatch.setattr(stages, "_build_flow", lambda *a: types.SimpleNamespace(deferred=jobs["f"]))
    monkeypatch.setattr(stages, "_build_vocoder", lambda *a: types.SimpleNamespace(deferred=jobs["v"]))
    models = types.SimpleNamespace(llm=None, flow=None, hift=None, dtype=torch.float32,
                                   device=torch.device("cpu"), family="cosyvoice2")
    cache = stages.StageCache(models, EngineConfig())
    cache.get(BackendConfig())
    assert cache.take_deferred() == jobs["f"] + jobs["v"] and cache.take_deferred() == []
    cache.get(BackendConfig())  # already built: nothing new
    assert cache.take_deferred() == []


# ------------------------------------------------------------------------------------------------ /health
def _worker(done: int, total: int, finished: bool, failed: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(done=done, total=total, failed=failed, finished=finished,
                                 seconds=12.5 if finished else None, on_done=None)


def test_health_and_the_page_say_ready_while_capturing_in_the_background():
    from cosyvoice_fast.serving.metrics import health

    p = StartupProgress(graphs=lambda: 0, clock=lambda: 50.0, since_process_start=False)
    worker = _worker(3, 10, finished=False)
    p.attach_background(worker)
    assert worker.on_done is not None  # the progress keeps the background's seconds in the compile cache record
    p.phase("ready")
    snap = p.snapshot()
    assert snap["phase"] == "ready" and p.ready and not p.settled
    assert snap["status"] == "ready — capturing 3/10 graphs in the background"
    assert snap["background"] == {"captured": 3, "planned": 10, "failed": 0, "finished": False, "seconds": None}
    assert p.line() == "Ready — capturing 3/10 graphs in the background."
    svc = types.SimpleNamespace(engine=types.SimpleNamespace(stats=lambda: {"running": True, "active": 0,
                                                                            "queued": 0, "stage_configs": []},
                                                             sample_rate=24000),
                                models=types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                                                             family="cosyvoice2"),
                                model_name="m", synthetic=True, frontend=None, warming=lambda: [], startup=p)
    h = health(svc)
    assert h["ready"] is True and h["startup"]["status"] == "ready — capturing 3/10 graphs in the background"
    worker.done, worker.finished, worker.seconds = 10, True, 12.5
    assert p.snapshot()["status"] == "ready" and p.line() == "" and p.settled


def test_a_server_without_background_work_is_settled_at_ready():
    p = StartupProgress(graphs=lambda: 0, clock=lambda: 50.0, since_process_start=False)
    p.phase("ready")
    assert p.settled and p.snapshot()["background"] is None and p.line() == ""


def test_the_background_seconds_land_in_the_compile_cache_record(tmp_path):
    from cosyvoice_fast.engine.startup import RECORD
    from cosyvoice_fast.kernels.compile_cache import open_compile_cache

    cache = open_compile_cache(tmp_path, {"gpu": "test"})
    p = StartupProgress(graphs=lambda: 0, clock=lambda: 50.0, since_process_start=False)
    p.attach_cache(cache)
    worker = BackgroundCaptures()
    p.attach_background(worker)
    p.phase("ready")
    worker.add([DeferredCapture("hift", (1,), lambda: None), DeferredCapture("hift", (2,), lambda: None)])
    assert worker.join(30)
    deadline = threading.Event()
    for _ in range(100):  # on_done runs right after the queue ran dry, on the worker thread
        rec = cache.read_record(RECORD) or {}
        if "background_s" in rec:
            break
        deadline.wait(0.05)
    assert rec["background_graphs"] == 2 and rec["background_failed"] == 0 and rec["background_s"] >= 0


@pytest.mark.gpu
def test_gpu_serving_while_graphs_are_captured_in_the_background_never_captures_on_a_request_thread(
        fixture_dir, load_case):
    from cosyvoice_fast.engine.engine import Engine
    from cosyvoice_fast.modeldir.files import load_models
    from test_serving_gpu import _request, _serve

    case = load_case("case_flow_stream")
    models = load_models(fixture_dir, device="cuda")
    cfg = EngineConfig(max_streams=4, llm_slots=4, max_context=512, flow_buckets=(50, 100, 150, 200, 300, 400, 600),
                       flow_rows=(1, 2, 4), vocoder_rows=(1, 2), background_capture=True)
    backend = BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", dtype="fp32", incremental=False)
    with Engine(models, backend=backend, config=cfg) as eng:
        fg = graphs.captures()
        assert eng.background.total > 0
        reqs = [_request(case, i) for i in range(8)]
        first = _serve(eng, reqs)  # while the background thread captures the rest
        assert all(first[i] == r.max_tokens * 960 for i, r in enumerate(reqs)), first
        assert eng.background.join(300) and eng.background.failed == 0, eng.background.errors
        assert graphs.captures() == fg, "a graph was captured on a request's thread"
        enc = eng.stages(backend).flow.encoder
        eager = enc.eager_calls
        again = _serve(eng, [_request(case, i) for i in range(8)])
        assert again == first and enc.eager_calls == eager  # every shape has its graph now
        assert graphs.captures() == fg and eng.stats()["background_captures"] >= eng.background.done
