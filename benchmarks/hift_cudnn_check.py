"""One GPU run: the fused vocoder's first-chunk graph with its cuDNN convolutions chosen by cuDNN's benchmark mode.

    PYTHONUNBUFFERED=1 python benchmarks/hift_cudnn_check.py --out $OUT/hift_cudnn_check.json

PyTorch picks a cuDNN convolution algorithm by heuristics unless ``torch.backends.cudnn.benchmark`` is on, when it
times the candidates for each new shape on first use.  The vocoder's start-up graphs record whichever algorithm
the warm-up call chose, so the choice can be made once, at capture.  Full-size HiFT (seeded, as the synthetic
model builds it; timing does not depend on weight values), the ``fused`` vocoder (time-major conv stack, fused
Snake units, TF32 convolutions as served), one row, mel lengths 50 and 56 (a first chunk).  Modes, each its own
vocoder with its graphs captured under the mode: ``heuristic`` (the default) and ``benchmark``.

Step ``chunk``: median GPU ms (CUDA events) of one ``vocode`` call per (mode, length), 50 calls, three alternating
rounds; the kernels of one call (and, for the first mode, their count and summed µs by name); the largest
waveform difference between the modes (the same noise draw).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import alternating_rounds, gpu_runner, step_args, time_call  # noqa: E402

LENGTHS = (50, 56)
#: PyTorch caches the cuDNN plan of a convolution by shape for the whole process, so the first vocoder built
#: decides for every later one: ``HIFT_CUDNN_MODES=benchmark`` (or ``heuristic``) runs one mode per process
MODES = tuple(os.environ.get("HIFT_CUDNN_MODES", "heuristic,benchmark").split(","))


def main() -> int:
    out, steps = step_args("chunk")
    runner = gpu_runner("hift_cudnn_check.py", out, step_timeout=400)

    def chunk() -> dict:
        from cosyvoice_fast.vocoder.fused import FusedVocoder
        from cosyvoice_fast.config.model import full_config
        from cosyvoice_fast.bench.estimator_profile import count_kernels, kernel_times
        from cosyvoice_fast.vocoder.model.hift import HiFTGenerator

        def build_hift() -> torch.nn.Module:  # as the synthetic model's (seed 0, default init, weight norm kept)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return HiFTGenerator(full_config().hift).cuda().eval().requires_grad_(False)

        vocs = {}
        saved = torch.backends.cudnn.benchmark
        for mode in MODES:
            torch.backends.cudnn.benchmark = mode == "benchmark"
            try:
                vocs[mode] = FusedVocoder(build_hift(), rows=(1,), lengths=LENGTHS, progress=False)
            finally:
                torch.backends.cudnn.benchmark = saved
        g = torch.Generator().manual_seed(0)
        mels = {n: (torch.randn(1, 80, n, generator=g) - 5).cuda() for n in LENGTHS}
        empty = torch.zeros(1, 1, 0, device="cuda")
        r: dict = {"kernels": {}, "wave_diff": {}}

        def call(mode: str, n: int):  # noqa: ANN202
            return lambda: vocs[mode].vocode(mels[n], empty, torch.Generator(device="cuda").manual_seed(1))

        with torch.inference_mode():
            for n in LENGTHS:
                waves = {m: call(m, n)()[0] for m in MODES}
                r["wave_diff"][str(n)] = (waves[MODES[-1]] - waves[MODES[0]]).abs().max().item()
                for m in MODES:
                    r["kernels"][f"{m}_{n}"] = count_kernels(call(m, n))
                by_name: dict = {}
                for name, us in kernel_times(call(MODES[0], n)):
                    entry = by_name.setdefault(name[:90], [0, 0.0])
                    entry[0] += 1
                    entry[1] = round(entry[1] + us, 1)
                r.setdefault("kernel_names", {})[str(n)] = by_name
            r.update(alternating_rounds({str(n): n for n in LENGTHS}, MODES,
                                        lambda n, m: time_call(call(m, n), warmup=3, iters=50)["median_ms"]))
        return r

    if "chunk" in steps:
        runner.run("chunk", chunk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
