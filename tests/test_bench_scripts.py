"""The benchmark scripts' shared step runner (``benchmarks/steps.py``) and the CPU-checkable parts of
``benchmarks/hift_profile.py``: a GPU call that goes wrong must still leave every earlier result on disk."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.steps import StepRunner  # noqa: E402


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_failing_step_is_recorded_and_the_next_step_runs(tmp_path):
    runner = StepRunner(tmp_path / "r.json", {"device": "cpu"})

    def boom() -> dict:
        raise ValueError("bad shape")

    assert runner.run("first", boom) is None
    assert runner.run("second", lambda: {"ms": 1.5}) == {"ms": 1.5}
    saved = _read(tmp_path / "r.json")
    assert saved["device"] == "cpu"
    assert saved["first"] == {"error": "ValueError: bad shape"}
    assert saved["second"] == {"ms": 1.5}
    assert saved["step_status"] == {"first": "error", "second": "ok"}
    assert saved["step_errors"] == {"first": "ValueError: bad shape"}
    assert set(saved["step_seconds"]) == {"first", "second"}
    assert not runner.ok("first") and runner.ok("second")


def test_json_is_rewritten_after_every_step(tmp_path):
    out = tmp_path / "sub" / "r.json"  # the parent is created
    runner = StepRunner(out)
    seen: list[dict] = []
    runner.run("a", lambda: 1)
    runner.run("b", lambda: seen.append(_read(out)) or 2)
    assert seen[0]["a"] == 1 and "b" not in seen[0]  # on disk before step b started
    assert _read(out)["b"] == 2
    assert not list(out.parent.glob(".*.tmp"))  # written through a temporary file, nothing left behind


def test_step_past_its_limit_is_recorded_as_timed_out(tmp_path):
    before = signal.getsignal(signal.SIGALRM)
    runner = StepRunner(tmp_path / "r.json", step_timeout=30)

    def slow() -> None:
        try:
            time.sleep(5)
        except Exception:  # noqa: BLE001 - a step's own broad handler must not swallow its time limit
            pass

    t0 = time.monotonic()
    assert runner.run("slow", slow, timeout=0.2) is None
    assert time.monotonic() - t0 < 2
    assert runner.run("after", lambda: "fine") == "fine"
    saved = _read(tmp_path / "r.json")
    assert saved["step_status"] == {"slow": "timeout", "after": "ok"}
    assert saved["slow"] == {"error": "timed out after 0.2 s"}
    assert signal.getsignal(signal.SIGALRM) == before  # the previous handler is back


def test_budget_skips_the_steps_after_it(tmp_path):
    runner = StepRunner(tmp_path / "r.json", budget_s=1.5)
    runner.run("uses_budget", lambda: time.sleep(0.6))
    called = []
    runner.run("late", lambda: called.append(1))
    assert runner.status("late") == "skipped" and not called
    assert "time budget" in _read(tmp_path / "r.json")["step_errors"]["late"]


def test_unstored_step_keeps_what_it_put_in_results(tmp_path):
    results: dict = {"rows": []}
    runner = StepRunner(tmp_path / "r.json", results)

    def appends() -> None:
        results["rows"].append(1)
        runner.save()
        raise RuntimeError("second row failed")

    runner.run("rows_step", appends, store=False)
    saved = _read(tmp_path / "r.json")
    assert saved["rows"] == [1] and "rows_step" not in saved
    assert saved["step_status"]["rows_step"] == "error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("name", ["hift_profile", "bf16_error", "nucleus_draw_check", "hift_conv_check"])
def test_gpu_script_without_cuda_exits_2_with_a_clear_message(tmp_path, name):
    script = [sys.executable, f"benchmarks/{name}.py"]
    helped = subprocess.run(script + ["--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--out" in helped.stdout
    ran = subprocess.run(script + ["--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2
    assert "needs a CUDA GPU" in ran.stderr
    assert not list(tmp_path.iterdir())


def test_hift_profile_conv_stack_bf16_seam_is_removed_afterwards(monkeypatch):
    from benchmarks import hift_profile as hp
    from cosyvoice_fast.config.model import tiny_config
    from cosyvoice_fast.vocoder.model.hift import HiFTGenerator

    monkeypatch.setattr(hp, "DEVICE_TYPE", "cpu")
    torch.manual_seed(0)
    hift = HiFTGenerator(tiny_config().hift).eval()
    mel = torch.randn(2, hift.cfg.in_channels, 6) - 5
    noise = torch.randn(hift.m_source.noise_shape(mel[:, 0]))
    with torch.inference_mode():
        ref = hp.forward(hift, mel, noise)
        with hp.fp32_methods(hift, hp.SPECTRAL_METHODS):
            assert "_waveform" in vars(hift)
            wav = hp.forward_conv_stack_bf16(hift, mel, noise)
    assert not set(hp.SPECTRAL_METHODS) & set(vars(hift))
    stats = hp.err_stats(wav, ref)
    assert stats["finite"] and 0 < stats["max_abs"] < 0.1
    assert hp.err_stats(ref, ref)["snr_db"] is None
    top = hp.top_kernels([("k" * 150, 3.0), ("b", 1.0), ("k" * 150, 2.0)], top=1)
    assert top["kernels"] == 3 and top["top"] == [{"name": "k" * 100, "count": 2, "total_ms": 0.005,
                                                    "share": 0.833}]


def test_alternating_rounds_alternate_the_modes_inside_each_round_and_take_medians():
    from benchmarks.steps import alternating_rounds

    seen = []
    times = iter([3.0, 1.0, 5.0, 2.0, 4.0, 9.0, 7.0, 6.0, 1.25, 0.5, 2.5, 8.0])

    def time_one(case: int, mode: str) -> float:
        seen.append((case, mode))
        return next(times)

    r = alternating_rounds({"a": 1, "b": 2}, ("x", "y"), time_one, rounds=3)
    assert seen == [(1, "x"), (1, "y"), (2, "x"), (2, "y")] * 3
    assert r["ms"] == {"a": {"x": [3.0, 4.0, 1.25], "y": [1.0, 9.0, 0.5]},
                       "b": {"x": [5.0, 7.0, 2.5], "y": [2.0, 6.0, 8.0]}}
    assert r["median_ms"] == {"a": {"x": 3.0, "y": 1.0}, "b": {"x": 5.0, "y": 6.0}}


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 5, **args: object) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_ttfb_trace_splits_each_stage_into_gpu_busy_and_idle_and_names_what_ended_each_gap():
    """A hand-made trace (µs): kernels at 1100-1200 and 1300-1350, a copy at 1500-1520, each launched by a
    runtime call; a project Python frame around the graph launch.  Stage windows in perf_counter seconds with
    the clock offset 0."""
    from benchmarks.ttfb_trace import analyse

    trace = {"traceEvents": [
        _x("ttfb_trace_clock", "user_annotation", 1000, 1),
        _x("gemm", "kernel", 1100, 100, correlation=1), _x("attn", "kernel", 1300, 50, correlation=2),
        _x("Memcpy HtoD", "gpu_memcpy", 1500, 20, correlation=3),
        _x("cudaLaunchKernel", "cuda_runtime", 1090, 5, correlation=1),
        _x("cudaGraphLaunch", "cuda_runtime", 1250, 40, correlation=2),
        _x("cudaMemcpyAsync", "cuda_runtime", 1480, 10, correlation=3),
        _x("cosyvoice_fast/runtime/x.py(1): f", "python_function", 1240, 60),
        _x("other.py(2): g", "python_function", 1245, 50),
        {"ph": "i", "name": "ignored", "ts": 1200}]}
    got = analyse(trace, 0.0, [("a", 0.001, 0.0014), ("b", 0.0014, 0.0016)])
    a, b = got["a"], got["b"]
    assert (a["ms"], a["gpu_busy_ms"], a["gpu_idle_ms"], a["gpu_activities"]) == (0.4, 0.15, 0.25, 2)
    assert (a["gaps_over_8us"], a["gap_ms_over_8us"]) == (3, 0.25)
    assert [(g["at_ms"], g["us"], g["launched_by"]) for g in a["longest_gaps"]] == [
        (0.0, 100, "cudaLaunchKernel"), (0.2, 100, "cudaGraphLaunch"), (0.35, 50, "cudaMemcpyAsync")]
    graph_gap = a["longest_gaps"][1]
    assert graph_gap["next_gpu"] == "attn" and graph_gap["launch_ts_in_gap_us"] == 50
    assert graph_gap["python"] == ["cosyvoice_fast/runtime/x.py(1): f"]  # only the project's frames
    assert (b["gpu_busy_ms"], b["gpu_idle_ms"], b["gpu_activities"]) == (0.02, 0.18, 1)
    assert [(g["us"], g["next_gpu"]) for g in b["longest_gaps"]] == [(100, "Memcpy HtoD"), (80, None)]


def test_host_path_check_wraps_methods_and_staticmethods_and_records_each_call(monkeypatch):
    from benchmarks import host_path_check as hp
    from cosyvoice_fast.engine.chunks import ChunkRunner
    from cosyvoice_fast.config.schedule import ChunkCursor

    for cls, name in ((ChunkCursor, "tokens_short"), (ChunkRunner, "_to_host")):
        monkeypatch.setattr(cls, name, cls.__dict__[name])  # restored after the test
    monkeypatch.setattr(hp, "CALLS", [])
    assert hp.wrap("schedule", "ChunkCursor", "tokens_short") == "ChunkCursor.tokens_short"
    assert hp.wrap("runtime.chunks", "ChunkRunner", "_to_host") == "ChunkRunner._to_host"
    assert hp.wrap("schedule", "ChunkCursor", "no_such_method") is None
    assert hp.wrap("no_such_module", "X", "y") is None
    from cosyvoice_fast.config.model import StreamParams

    cursor = ChunkCursor(8, StreamParams())
    assert cursor.tokens_short(40) == 5 and ChunkRunner._to_host([]) == []
    assert [c[0] for c in hp.CALLS] == ["ChunkCursor.tokens_short", "ChunkRunner._to_host"]
    assert all(t1 >= t0 for _, _, t0, t1 in hp.CALLS)


def test_ab_rounds_alternates_the_variants_and_leaves_the_last_patched_in(tmp_path, monkeypatch):
    """The same-process A/B loop: each round runs every variant once, in reversed order every other round,
    each right after patching it in; the service is closed and the shipped (last) variant stays in."""
    from types import SimpleNamespace

    from benchmarks import one_stream
    from cosyvoice_fast.bench import engine_bench as bench

    applied, measured = [], []
    p50 = iter([41.0, 40.0, 40.5, 39.5, 42.0, 39.0])

    def bench_config(engine, backend, concurrency, requests, args):  # noqa: ANN001
        assert concurrency == 1 and requests == 7
        measured.append(applied[-1])
        return {"ttfb_ms": {"p50": next(p50), "p95": 50.0}, "ttfb.prefill_ms": {"p50": 2.0}, "n": requests}

    monkeypatch.setattr(bench, "bench_config", bench_config)
    closed = []
    svc = SimpleNamespace(models=SimpleNamespace(device=torch.device("cpu")), engine=None,
                          close=lambda: closed.append(True))
    one = one_stream.OneStream(svc, SimpleNamespace(), None, lambda seed: None)
    variants = {"old": lambda: applied.append("old"), "new": lambda: applied.append("new")}
    res = one_stream.ab_rounds(one, variants, 3, 7, tmp_path / "ab.json", ["--x"])
    assert measured == ["old", "new", "new", "old", "old", "new"]
    assert applied[-1] == "new" and closed == [True]
    assert res["old_ttfb_p50_median"] == 41.0 and res["new_ttfb_p50_median"] == 40.0
    assert _read(tmp_path / "ab.json")["rounds"][1]["new"]["ttfb_ms"]["p50"] == 40.5


def test_swap_rounds_measures_each_variant_with_its_value_in_place(tmp_path, monkeypatch):
    """The stage-swapping A/B (``vocoder_ab``, ``decode_tail_ab``): each measurement runs with its variant's
    value in the target's attribute, and the last (shipped) value stays."""
    from types import SimpleNamespace

    from benchmarks import one_stream
    from cosyvoice_fast.bench import engine_bench as bench

    target, seen = SimpleNamespace(vocoder=None), []

    def bench_config(engine, backend, concurrency, requests, args):  # noqa: ANN001
        seen.append(target.vocoder)
        return {"ttfb_ms": {"p50": 40.0, "p95": 41.0}, "n": requests}

    monkeypatch.setattr(bench, "bench_config", bench_config)
    svc = SimpleNamespace(models=SimpleNamespace(device=torch.device("cpu")), engine=None, close=lambda: None)
    one = one_stream.OneStream(svc, SimpleNamespace(), None, lambda seed: None)
    one_stream.swap_rounds(one, target, "vocoder", {"cudnn": "A", "triton": "B"}, 2, 3, tmp_path / "ab.json", [])
    assert seen == ["A", "B", "B", "A"] and target.vocoder == "B"


def test_stage_ab_refuses_a_preset_without_the_stage_it_compares(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks import one_stream

    backend = SimpleNamespace(vocoder="cudagraph", llm="fused")
    monkeypatch.setattr(one_stream, "load", lambda argv, prog: one_stream.OneStream(None, None, backend, None))
    with pytest.raises(SystemExit, match="benchmarks/vocoder_ab.py compares 'fused' vocoder stages; --backends gave "
                                         "vocoder 'cudagraph'"):
        one_stream.stage_ab(["--out", str(tmp_path), "--"], None, "benchmarks/vocoder_ab.py", "vocoder", "fused")


def test_decode_tail_ab_takes_its_variants_through_stage_ab_and_refuses_unknown_ones(tmp_path, monkeypatch):
    """``--variants`` is declared through ``stage_ab``'s ``add`` hook beside the A/B flags; a name that is not a
    variant stops the script before any stage is built."""
    from types import SimpleNamespace

    from benchmarks import decode_tail_ab, one_stream

    backend = SimpleNamespace(llm="fused")
    monkeypatch.setattr(one_stream, "load", lambda argv, prog: one_stream.OneStream(None, None, backend, None))
    argv = ["--out", str(tmp_path), "--variants", "floor", "--rounds", "2", "--"]
    with pytest.raises(SystemExit):  # argparse: --variants is not an A/B flag of its own
        one_stream.stage_ab(argv, None, "p", "llm", "fused")
    with pytest.raises(AttributeError):  # past the flags: the stub service has no engine
        one_stream.stage_ab(argv, None, "p", "llm", "fused", decode_tail_ab._add_variants)
    monkeypatch.setattr(one_stream, "stage_ab", lambda *a: (SimpleNamespace(variants="before,nope"), tmp_path,
                                                            None, None, None))
    with pytest.raises(SystemExit, match=r"unknown variants \['nope'\]; choose from \['before', 'floor'\]"):
        decode_tail_ab.main([])


def _sass_sizes(tmp_path: Path, what: str) -> dict:
    """``benchmarks/sass_sizes.py --what WHAT``'s result for WHAT (needs Triton, not a GPU)."""
    pytest.importorskip("triton")
    out = tmp_path / "sass.json"
    run = subprocess.run([sys.executable, "benchmarks/sass_sizes.py", "--out", str(out), "--what", what],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())[what]


def test_sass_sizes_counts_every_kernel_of_a_decode_step_without_a_gpu(tmp_path):
    """The code-size tool records a full-size one-row decode step's launches under the interpreter without
    running them (the embedding gather, five kernels per layer, the head) and compiles each distinct one for
    sm_90 with the Triton installed here."""
    decode = _sass_sizes(tmp_path, "decode")
    assert decode["launches"] == 5 * 24 + 2 and decode["variants"] == 7
    sizes = {r["kernel"]: r["sass"] for r in decode["kernels"]}
    assert set(sizes) == {"_embed_kernel", "_qkv_gemv_kernel", "_attn_split_kernel", "_proj_gemv_kernel",
                          "_gate_up_gemv_kernel", "_head_gemv_kernel"}
    assert all(n > 0 for n in sizes.values()) and min(sizes, key=sizes.get) == "_embed_kernel"
    assert all(1 <= r["registers"] <= 255 and r["stack"] >= 0 and r["shared"] >= 0 for r in decode["kernels"])


def test_sass_sizes_covers_a_looped_sixteen_row_step(tmp_path):
    """``--what decode16``: a 16-row step launches the looped projections (q/k/v, attention, o and down, gate/up
    per layer) and the looped head, its gather being torch ops; each compiled variant reports its registers and
    spill stack."""
    step = _sass_sizes(tmp_path, "decode16")
    assert step["launches"] == 5 * 24 + 1
    assert {r["kernel"] for r in step["kernels"]} == {"_qkv_rope_kernel", "_attn_split_kernel",
                                                      "_proj_residual_kernel", "_gate_up_kernel", "_head_kernel"}
    assert all(1 <= r["registers"] <= 255 and r["stack"] >= 0 for r in step["kernels"])


@pytest.mark.parametrize("head", ["_head_gemv_kernel", "_head_kernel", "void cutlass::Kernel2<cutlass_80_wmma_te"])
def test_device_ras_timeline_cuts_rounds_at_the_read_kernel_and_measures_idle_and_tail(head):
    """Two whole rounds (and the start of a third) of hand-made GPU events, µs: a round is read, exponentials,
    gather, a layer, the head (either fused one, or cuBLAS's), a softmax, the advance, then a copy; the GPU
    idles 30 µs before the next read."""
    from types import SimpleNamespace

    from benchmarks.device_ras_check import _timeline

    def ev(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = []
    for t in (0.0, 200.0):
        events += [ev("_read_kernel", t, t + 2), ev("_exponential_kernel", t + 3, t + 5),
                   ev("_embed_kernel", t + 4, t + 6), ev("_proj_gemv_kernel", t + 5, t + 120),
                   ev(head, t + 100, t + 130), ev("softmax", t + 132, t + 140),
                   ev("_advance_kernel", t + 150, t + 160), ev("Memcpy DtoH", t + 165, t + 170)]
    events.append(ev("_read_kernel", 400.0, 402.0))
    got = _timeline(list(reversed(events)))  # any order: it sorts by start
    assert got["rounds"] == 2
    med = got["median_us"]
    # busy: read 2 + [3, 130] 127 + softmax 8 + advance 10 + copy 5 = 152 of the 200 between two reads
    assert (med["period"], med["busy"], med["idle"]) == (200.0, 152.0, 48.0)
    assert (med["graph"], med["between_graphs"], med["decoder"], med["tail"]) == (160.0, 40.0, 126.0, 30.0)
    first = got["tail_of_one_round_us_from_head_end"]
    assert first[0] == ["_proj_gemv_kernel", -125.0, 115.0] and first[-1] == ["_read_kernel", 70.0, 0.0]


def test_device_ras_timeline_takes_the_last_cublas_gemm_of_a_round_as_the_head():
    """A cuBLAS step (32+ rows) runs GEMMs of other shapes (other kernel names) in every layer as well: the
    decoder ends at the round's last GEMM, not at the first name that looks like one."""
    from types import SimpleNamespace

    from benchmarks.device_ras_check import _timeline

    def ev(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    gemm, layer_gemm = "void cutlass::Kernel2<cutlass_80_wmma_te", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"
    events = []
    for t in (0.0, 300.0):
        events += [ev("_read_kernel", t, t + 2), ev("index_select", t + 3, t + 5), ev(layer_gemm, t + 10, t + 40),
                   ev("_attn_split_kernel", t + 41, t + 60), ev(layer_gemm, t + 61, t + 200),
                   ev(gemm, t + 210, t + 230),
                   ev("_advance_kernel", t + 250, t + 260)]
    events.append(ev("_read_kernel", 600.0, 602.0))
    med = _timeline(events)["median_us"]
    assert (med["decoder"], med["tail"]) == (227.0, 30.0)


def test_device_ras_check_tile_ways_combine_into_tiles_fields():
    from benchmarks.device_ras_check import _tile_way

    assert _tile_way("qkv_split1+norm_sums_off") == {"qkv_split": 1, "norm_sums": False}
    assert _tile_way("before_session32+head64+gate_up_split2") == {"looped_head": False, "head": 64,
                                                                   "gate_up_split": 2}
    assert _tile_way("before_session28") == {"gemv_head": False, "looped_head": False}
    assert _tile_way("ahead") is None and _tile_way("qkv_split4+token_copy") is None
    assert _tile_way("qkv_splitx") is None
