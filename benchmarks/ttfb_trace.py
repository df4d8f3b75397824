"""Where one stream's time to first audio goes between the GPU's work: a profiler trace of single requests.

    PYTHONUNBUFFERED=1 python benchmarks/ttfb_trace.py --out $OUT --requests 4 [--stack] -- \
        --synthetic full --backends fused --dtype bf16

The bench reports TTFB as stages (prefill, decode, flow, vocoder, hand-off) measured on the host.  Each stage is
GPU work plus the host work around it, and at one stream the GPU waits for the host in between.  This script
runs requests one at a time (concurrency 1, the bench's synthetic workload: ``--prompt-tokens``, ``--text-tokens``,
``--gen-tokens``), each under ``torch.profiler`` (CPU and CUDA activity) from its submission to its first chunk, and
lays the request's own stage timestamps on the trace.  Per stage: the GPU's busy time (union of kernels, copies
and memsets on every stream) and idle time, and the longest idle gaps with what ended them: the runtime call that
launched the next GPU activity and, with ``--stack`` (Python tracer on; slower host, so only for attribution),
the Python functions around that call.  Results: ``OUT/ttfb_trace.json``; the first request's trace as
``OUT/trace_0.json.gz`` (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MARK = "ttfb_trace_clock"


def stage_windows(tele: Any) -> list[tuple[str, float, float]]:
    """The request's TTFB stages as (name, start, end) perf_counter seconds (the telemetry's own split)."""
    c = tele.chunks[0]
    points = [("submit", tele.received), ("prefill_start", tele.prefill_start), ("prefill_done", tele.prefill_done),
              ("tokens_ready", c.tokens_ready), ("flow_start", c.flow_start), ("flow_end", c.flow_end),
              ("vocoder_end", c.vocoder_end), ("delivered", c.delivered)]
    names = ("front+queue", "llm_prefill", "llm_decode", "queue", "flow", "vocoder", "handoff")
    return [(n, a[1], b[1]) for n, a, b in zip(names, points, points[1:])]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def analyse(trace: dict[str, Any], offset_us: float, windows: list[tuple[str, float, float]],
            top: int = 12, min_gap_us: float = 8.0) -> dict[str, Any]:
    """Per stage window (perf_counter seconds; ``offset_us`` maps them onto the trace's µs): GPU busy / idle µs,
    GPU activities, and the longest idle gaps, each named by the runtime call that launched the activity ending
    it (and that call's enclosing Python functions when the trace has them)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "args" in e}
    py = [e for e in events if e.get("cat") == "python_function"]
    py_by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in py:
        py_by_tid.setdefault(e["tid"], []).append(e)

    def enclosing(rt: dict[str, Any]) -> list[str]:
        t0, t1 = rt["ts"], rt["ts"] + rt.get("dur", 0)
        frames = [e for e in py_by_tid.get(rt["tid"], []) if e["ts"] <= t0 and e["ts"] + e.get("dur", 0) >= t1]
        frames.sort(key=lambda e: e["ts"])
        names = [e["name"] for e in frames if "cosyvoice_fast" in e["name"] or "benchmarks" in e["name"]]
        return names[-6:]

    busy_all = union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu])
    starts = [e["ts"] for e in gpu]
    out: dict[str, Any] = {}
    for name, a, b in windows:
        lo, hi = a * 1e6 + offset_us, b * 1e6 + offset_us
        busy = clip(busy_all, lo, hi)
        busy_us = sum(y - x for x, y in busy)
        edges = [lo] + [p for iv in busy for p in iv] + [hi]
        gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] - edges[i] >= min_gap_us]
        described = []
        for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
            nxt = gpu[bisect_left(starts, g1)] if bisect_left(starts, g1) < len(gpu) else None
            rt = runtime.get(nxt["args"].get("correlation")) if nxt is not None and "args" in nxt else None
            described.append({
                "at_ms": (g0 - lo) / 1e3, "us": g1 - g0,
                "next_gpu": nxt["name"][:80] if nxt is not None else None,
                "launched_by": rt["name"] if rt is not None else None,
                "launch_ts_in_gap_us": (rt["ts"] - g0) if rt is not None else None,
                "python": enclosing(rt) if rt is not None and py else []})
        n_gpu = sum(1 for e in gpu if lo <= e["ts"] < hi)
        out[name] = {"ms": (hi - lo) / 1e3, "gpu_busy_ms": busy_us / 1e3, "gpu_idle_ms": (hi - lo - busy_us) / 1e3,
                     "gpu_activities": n_gpu, "gaps_over_8us": len(gaps),
                     "gap_ms_over_8us": sum(y - x for x, y in gaps) / 1e3, "longest_gaps": described}
    return out


def main(argv: list[str]) -> None:
    from benchmarks import one_stream
    from cosyvoice_fast.bench import engine_bench as bench

    def flags(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--requests", type=int, default=4)
        ap.add_argument("--warmup", type=int, default=3)
        ap.add_argument("--stack", action="store_true", help="record Python functions too (slower host)")

    mine, bench_argv, out = one_stream.script_args(argv, __doc__, "benchmarks/ttfb_trace.py", flags)
    one = one_stream.load(bench_argv, "benchmarks/ttfb_trace.py")
    svc, make = one.svc, one.make
    engine, dev = svc.engine, svc.models.device

    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "args": argv, "stack": mine.stack, "requests": []}
    try:
        for i in range(mine.warmup):
            bench.run_wave(engine, [make(10_000 + i)])
        for r in range(mine.requests):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            prof = torch.profiler.profile(activities=acts, with_stack=mine.stack)
            prof.__enter__()
            with torch.profiler.record_function(MARK):
                clock = time.perf_counter()
            stream = engine.stream(make(r))
            it = iter(stream)
            next(it)  # the first chunk: TTFB ends here
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            prof.__exit__(None, None, None)
            for _ in it:  # let the request finish outside the trace (the next one starts on an idle engine)
                pass
            tele = stream.telemetry
            path = out / f"trace_{r}.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            if r == 0:
                with gzip.open(out / "trace_0.json.gz", "wt") as f:
                    json.dump(trace, f)
            path.unlink()
            mark = next(e for e in trace["traceEvents"] if e.get("name") == MARK)
            offset = mark["ts"] - clock * 1e6
            row = {"ttfb_ms": tele.ttfb * 1e3, "breakdown_ms": tele.ttfb_breakdown(),
                   "stages": analyse(trace, offset, stage_windows(tele))}
            results["requests"].append(row)
            print(f"request {r}: TTFB {row['ttfb_ms']:.2f} ms; " + ", ".join(
                f"{k} {v['ms']:.2f} (GPU idle {v['gpu_idle_ms']:.2f})" for k, v in row["stages"].items()), flush=True)
            (out / "ttfb_trace.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        svc.close()
    rows = results["requests"]
    if rows:
        results["median"] = {k: {f: statistics.median(r["stages"][k][f] for r in rows)
                                 for f in ("ms", "gpu_busy_ms", "gpu_idle_ms", "gpu_activities")}
                             for k in rows[0]["stages"]}
        (out / "ttfb_trace.json").write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps(results["median"], indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
