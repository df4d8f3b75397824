"""The scripts under ``benchmarks/``: each answers ``--help`` on a machine without a GPU, the shared step runner
(``benchmarks/steps.py``) leaves every earlier result on disk when a GPU call goes wrong, and ``ttfb_trace``'s
trace analysis reads a hand-made trace right."""

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
def test_gpu_script_without_cuda_exits_2_with_a_clear_message(tmp_path):
    name = "bf16_error"
    script = [sys.executable, f"benchmarks/{name}.py"]
    helped = subprocess.run(script + ["--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--out" in helped.stdout
    ran = subprocess.run(script + ["--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2
    assert "needs a CUDA GPU" in ran.stderr
    assert not list(tmp_path.iterdir())


SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_the_kept_scripts_are_the_ones_benchmarks_readme_lists():
    readme = (REPO / "benchmarks" / "README.md").read_text()
    assert SCRIPTS == ["bf16_error", "memory_soak", "one_stream", "serve_profile", "steps", "ttfb_trace",
                       "upstream_ttfb"]
    for name in SCRIPTS:
        assert f"`{name}.py`" in readme, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_answers_help_with_status_0_without_a_gpu(name):
    """``python benchmarks/X.py --help`` works on a CPU box: no Triton or CUDA needed to read what a script does."""
    run = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.stdout.strip()) > 40  # usage or the docstring, not silence


def test_a_script_that_needs_bench_flags_refuses_a_call_without_them():
    """Without ``--`` (and not asking for help), ``ttfb_trace`` stops with its docstring and status 1."""
    run = subprocess.run([sys.executable, "benchmarks/ttfb_trace.py", "--out", "x"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "profiler trace of single requests" in run.stderr


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


