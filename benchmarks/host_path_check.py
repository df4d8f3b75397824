"""Host time on one stream's path to first audio, without a profiler: wrapped calls timed with ``perf_counter``.

    PYTHONUNBUFFERED=1 python benchmarks/host_path_check.py --out $OUT --requests 12 -- \
        --synthetic full --backends fused --dtype bf16

Under ``torch.profiler`` (``benchmarks/ttfb_trace.py``) every CUDA call costs more on the host (a graph launch
~0.1-0.5 ms instead of microseconds), so its host gaps overstate.  Here a few engine and backend functions on the
first chunk's path are wrapped with a timer (~1 µs each) and requests run one at a time like the bench's
concurrency 1.  Per request, for each wrapped function: its calls between the request's receipt and its first
chunk's delivery, their summed host ms and the first call's.  Step ``copies`` also times small host-to-device
copies of the request's kind after an idle gap, from pageable and pinned memory, on a long-lived and on a new
thread.  Results: ``OUT/host_path_check.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (module under cosyvoice_fast, class, method) timed on the path
TARGETS = (
    ("engine", "Engine", "_admit_checked"),
    ("request", "ModelInputs", "to"),
    ("runtime.scheduler", "Scheduler", "_start_segments"),
    ("runtime.scheduler", "Scheduler", "_open_segment"),
    ("models.llm", "Qwen2LM", "build_lm_input"),
    ("backends.cudagraph_llm", "CudaGraphLLM", "prefill"),
    ("backends.cudagraph_llm", "CudaGraphLLM", "_prefill_draw"),
    ("backends.llm_prefill", "BatchedPrefill", "run"),
    ("runtime.scheduler", "Scheduler", "sync"),
    ("runtime.scheduler", "Scheduler", "_take_token"),
    ("backends.cudagraph_llm", "CudaGraphLLM", "decode"),
    ("runtime.chunks", "ChunkRunner", "run"),
    ("runtime.chunks", "ChunkRunner", "_flow"),
    ("backends.graph_encoder", "GraphEncoder", "encode_calls"),
    ("backends.graph_encoder", "GraphEncoder", "_run"),
    ("models.flow", "CausalMaskedDiffWithXvec", "decode"),
    ("models.cfm", "CausalCFM", "solve_batch"),
    ("models.cfm", "CausalCFM", "guidance_batch"),
    ("backends.cudagraph_flow", "CudaGraphFlow", "chunk"),
    ("backends.cudagraph_incremental", "GraphIncrementalFlow", "chunk"),
    ("backends.cudagraph_flow", "CudaGraphFlow", "solve"),
    ("backends.cudagraph_flow", "CudaGraphFlow", "recompute"),
    ("backends.graph_solve", "StepGraphs", "solve"),
    ("backends.cudagraph_vocoder", "CudaGraphVocoder", "vocode"),
    ("backends.cudagraph_vocoder", "CudaGraphVocoder", "vocode_batch"),
    ("runtime.chunks", "ChunkRunner", "_vocode_and_emit"),
    ("runtime.chunks", "ChunkRunner", "_to_host"),
    ("runtime.chunks", "ChunkRunner", "_emit"),
)

CALLS: list[tuple[str, str, float, float]] = []  # (name, thread, start, end)


def wrap(module: str, cls_name: str, method: str) -> str | None:
    try:
        cls = getattr(importlib.import_module(f"cosyvoice_fast.{module}"), cls_name)
    except (ImportError, AttributeError):
        return None
    fn = cls.__dict__.get(method)
    if fn is None:
        return None
    name = f"{cls_name}.{method}"
    is_static = isinstance(fn, staticmethod)
    inner = fn.__func__ if is_static else fn

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            CALLS.append((name, threading.current_thread().name, t0, time.perf_counter()))

    setattr(cls, method, staticmethod(timed) if is_static else timed)
    return name


def copies_step(dev: torch.device, rounds: int = 20) -> dict[str, Any]:
    """ms per ``.to(dev)`` of a (1, 30) int32 tensor (plus a stream sync) after 5 ms idle: pageable vs pinned
    (``non_blocking``), on this thread and on a fresh thread per copy."""
    src = torch.randint(0, 100, (1, 30), dtype=torch.int32)
    pinned = src.pin_memory()

    def one(x: torch.Tensor, nb: bool) -> float:
        time.sleep(0.005)
        t0 = time.perf_counter()
        x.to(dev, non_blocking=nb)
        torch.cuda.current_stream(dev).synchronize()
        return (time.perf_counter() - t0) * 1e3

    out: dict[str, Any] = {}
    for label, x, nb in (("pageable", src, False), ("pinned", pinned, True)):
        out[f"{label}_same_thread_ms"] = statistics.median(one(x, nb) for _ in range(rounds))
        times: list[float] = []
        for _ in range(rounds):
            th = threading.Thread(target=lambda: times.append(one(x, nb)))
            th.start()
            th.join()
        out[f"{label}_new_thread_ms"] = statistics.median(times)
    return out


def main(argv: list[str]) -> None:
    from benchmarks import one_stream
    from cosyvoice_fast.bench import engine_bench as bench

    def flags(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--requests", type=int, default=12)
        ap.add_argument("--warmup", type=int, default=3)

    mine, bench_argv, out = one_stream.script_args(argv, __doc__, "benchmarks/host_path_check.py", flags)
    wrapped = [n for n in (wrap(*t) for t in TARGETS) if n is not None]
    one = one_stream.load(bench_argv, "benchmarks/host_path_check.py")
    svc, make = one.svc, one.make
    engine, dev = svc.engine, svc.models.device

    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "args": argv, "wrapped": wrapped, "requests": []}
    try:
        for i in range(mine.warmup):
            bench.run_wave(engine, [make(10_000 + i)])
        for r in range(mine.requests):
            CALLS.clear()
            tele = bench.run_wave(engine, [make(r)])[0]
            lo, hi = tele.received, tele.chunks[0].delivered
            per: dict[str, dict[str, float]] = {}
            for name, thread, t0, t1 in sorted(CALLS, key=lambda c: c[2]):
                if lo <= t0 <= hi:
                    rec = per.setdefault(name, {"calls": 0, "ms": 0.0, "first_ms": (t1 - t0) * 1e3,
                                                "first_at_ms": (t0 - lo) * 1e3, "thread": thread})
                    rec["calls"] += 1
                    rec["ms"] += (t1 - t0) * 1e3
            results["requests"].append({"ttfb_ms": tele.ttfb * 1e3, "breakdown_ms": tele.ttfb_breakdown(),
                                        "calls": per})
        rows = results["requests"]
        names = sorted({n for r in rows for n in r["calls"]}, key=lambda n: statistics.median(
            r["calls"][n]["first_at_ms"] for r in rows if n in r["calls"]))
        results["median"] = {
            "ttfb_ms": statistics.median(r["ttfb_ms"] for r in rows),
            "breakdown_ms": {k: statistics.median(r["breakdown_ms"][k] for r in rows) for k in rows[0]["breakdown_ms"]},
            "calls": {n: {f: statistics.median(r["calls"][n][f] for r in rows if n in r["calls"])
                          for f in ("calls", "ms", "first_ms", "first_at_ms")} for n in names}}
        if dev.type == "cuda":
            results["copies"] = copies_step(dev)
    finally:
        svc.close()
        (out / "host_path_check.json").write_text(json.dumps(results, indent=1, default=str))
    m = results["median"]
    print(f"TTFB p50 {m['ttfb_ms']:.2f} ms; " + ", ".join(f"{k} {v:.2f}" for k, v in m["breakdown_ms"].items()))
    for n, v in m["calls"].items():
        print(f"  {n:36s} at {v['first_at_ms']:7.2f} ms  first {v['first_ms']:7.3f} ms  total {v['ms']:7.3f} ms "
              f" calls {v['calls']:.0f}")
    print(json.dumps(results.get("copies"), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
