"""Where a serving run's GPU time goes: ``python -m cosyvoice_fast.bench`` under ``torch.profiler`` (CUDA
activity only), kernel time summed per stage.

    PYTHONUNBUFFERED=1 python benchmarks/serve_profile.py --out $OUT -- --synthetic full --backends fused ...

Everything after ``--`` goes to the bench (``--gpu-busy`` is added: the profiler runs exactly while the bench's
GPU-busy sampler does, i.e. over the timed waves of every concurrency, not start-up or warm-up).  The profiler
slows the run down, so the shares, not the totals, are the result.  A kernel's stage comes from its name: the
Triton kernels of ``cosyvoice_fast.kernels.estimator_*`` are the flow estimator's, ``qwen2_*``/``philox``/
``nucleus_*``/``ras_*``/``step_feed`` the LLM's, ``hift_*`` the vocoder's; every other kernel (cuBLAS, cuDNN,
PyTorch's own) is listed by name under "other".
Results: ``OUT/serve_profile.json`` (per stage: kernel ms, launches; the 60 costliest kernel names; and the GPU's
idle gaps: the time no kernel or copy ran on any stream, summed by the kernels on either side of each gap, which
tells which hand-over between host and GPU leaves it idle).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyvoice_fast.bench import gpu_busy  # noqa: E402

STAGE_OF_MODULE = (("estimator_", "flow estimator"), ("qwen2_", "llm"), ("philox", "llm"), ("nucleus", "llm"),
                   ("ras_", "llm"), ("step_feed", "llm"), ("hift_", "vocoder"))


def kernel_stages() -> dict[str, str]:
    """Triton kernel name -> stage, from the ``cosyvoice_fast.kernels`` modules that define them."""
    import triton

    from cosyvoice_fast import kernels

    out: dict[str, str] = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        stage = next((s for prefix, s in STAGE_OF_MODULE if info.name.startswith(prefix)), None)
        if stage is None:
            continue
        mod = importlib.import_module(f"cosyvoice_fast.kernels.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                out[name] = stage
    return out


def main(argv: list[str]) -> None:
    if "--" not in argv:
        from benchmarks.one_stream import exit_with_doc

        exit_with_doc(__doc__, argv)
    split = argv.index("--")
    mine, bench_args = argv[:split], argv[split + 1:]
    out = Path(mine[mine.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    stages = kernel_stages()
    # CPU ops on a machine without a GPU: only to check this script's plumbing (every op lands in "other")
    on_gpu = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
    device_type = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    profiles: list[torch.profiler.profile] = []
    sampler = gpu_busy.GpuBusy

    class ProfiledBusy:
        """The bench's GPU-busy sampler with the profiler running alongside it (the timed waves)."""

        def __init__(self, dev: torch.device):
            self.inner = sampler(dev)
            self.prof = torch.profiler.profile(activities=[activity])

        def __enter__(self):  # noqa: ANN204
            self.prof.__enter__()
            return self.inner.__enter__()

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)
            if on_gpu:
                torch.cuda.synchronize()
            self.prof.__exit__(*exc)
            profiles.append(self.prof)

    gpu_busy.GpuBusy = ProfiledBusy  # the bench imports it when runpy runs it below
    t0 = time.perf_counter()
    sys.argv = ["cosyvoice_fast.bench.engine_bench", *bench_args, "--gpu-busy", "--out", str(out / "bench")]
    try:
        runpy.run_module("cosyvoice_fast.bench.engine_bench", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the bench's own exit: the profile is still summed
        if e.code not in (None, 0):
            raise
    finally:
        gpu_busy.GpuBusy = sampler
    wall = time.perf_counter() - t0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for prof in profiles:
        for e in prof.events():
            if e.device_type == device_type:
                rec = by_name[e.name]
                rec[0] += e.device_time if on_gpu else e.cpu_time
                rec[1] += 1
    by_stage: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in by_name.items():
        stage = next((s for k, s in stages.items() if name.startswith(k)), "other")
        by_stage[stage][0] += us
        by_stage[stage][1] += n
    total = sum(us for us, _ in by_stage.values())
    result = {
        "gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "bench_args": bench_args, "wall_s": wall,
        "profiled_sections": len(profiles),
        "kernel_ms_total": total / 1e3,
        "stages": {s: {"kernel_ms": us / 1e3, "share": us / total, "launches": n}
                   for s, (us, n) in sorted(by_stage.items(), key=lambda kv: -kv[1][0])},
        "top_kernels": [{"name": name[:120], "ms": us / 1e3, "launches": n,
                         "stage": next((s for k, s in stages.items() if name.startswith(k)), "other")}
                        for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:60]],
    }
    result["idle"] = idle_gaps(profiles, device_type, lambda n: next((s for k, s in stages.items()
                                                                      if n.startswith(k)), n[:48]))
    (out / "serve_profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["stages"], indent=1))


def idle_gaps(profiles: list, device_type: object, label: object, top: int = 30) -> dict:
    """Idle time of the device between its activities (all streams merged), by (label of the activity that
    ended last before the gap, label of the one after it).  ``label(name)`` names a kernel's stage."""
    span = idle = 0.0
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for prof in profiles:
        ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == device_type), key=lambda x: x[0])
        if not ev:
            continue
        span += ev[-1][1] - ev[0][0]
        end, last = ev[0][1], ev[0][2]
        for start, stop, name in ev[1:]:
            if start > end:
                gap = start - end
                idle += gap
                rec = by_pair[(label(last), label(name))]
                rec[0] += gap
                rec[1] += 1
            if stop > end:
                end, last = stop, name
    pairs = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": span / 1e3, "idle_ms": idle / 1e3, "idle_share": idle / span if span else 0.0,
            "gaps": [{"before": a, "after": b, "ms": us / 1e3, "count": n, "mean_us": us / n}
                     for (a, b), (us, n) in pairs]}


if __name__ == "__main__":
    main(sys.argv[1:])
