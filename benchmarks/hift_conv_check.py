"""One GPU run: the fused vocoder with its ``Conv1d`` layers as Triton kernels against cuDNN's.

    PYTHONUNBUFFERED=1 python benchmarks/hift_conv_check.py --out $OUT/hift_conv_check.json [--steps chunk,rows,tiles]

Full-size HiFT (seeded, as the synthetic model builds it; timing does not depend on weight values), the ``fused``
vocoder as served (time-major conv stack, TF32 where cuDNN would use it), ``triton_convs`` off (``cudnn``) and on
(``triton``: :mod:`cosyvoice_fast.vocoder.kernels.hift_conv`).

- ``chunk``: one row at mel lengths 50 (a new voice's first chunk) and 56: median GPU ms (CUDA events) of one
  ``vocode`` call per (mode, length), 50 calls, three alternating rounds; kernels per call and, per mode at 50
  frames, their count and summed µs by name; each mode's waveform against fp32 HiFT with TF32 off on the same
  excitation (max, mean, SNR); the largest f0 difference between the modes.
- ``rows``: 4 and 16 rows at 56 frames through ``vocode_batch`` (the start-up batch graphs), same timing.
- ``tiles``: the Triton mode at one row, 50 frames, with ``hift_conv.MIN_PROGRAMS`` at 66 or 264, 64-channel
  input blocks for narrow time tiles, 2 or 4 pipeline stages; with ``rows16`` among the steps also at 16 rows,
  56 frames, with other largest tiles, 8 warps, 2 or 4 stages, and cuDNN's convolutions (each a vocoder captured
  under its setting; the Triton mode is built with ``LAUNCH["max_rows"]`` lifted, so every row count runs it;
  every setting compiles its own kernels, minutes in all).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import alternating_rounds, gpu_runner, step_args, time_call  # noqa: E402

LENGTHS = (50, 56)
MODES = ("cudnn", "triton")


def main() -> int:
    out, steps = step_args("chunk,rows,tiles")
    runner = gpu_runner("hift_conv_check.py", out, step_timeout=420)
    from cosyvoice_fast.vocoder.fused import FusedVocoder
    from cosyvoice_fast.config.model import full_config
    from cosyvoice_fast.vocoder.kernels import hift_conv
    from cosyvoice_fast.bench.estimator_profile import count_kernels, kernel_times
    from cosyvoice_fast.vocoder.model.hift import HiFTGenerator

    def build_hift() -> torch.nn.Module:  # as the synthetic model's (seed 0, default init, weight norm kept)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return HiFTGenerator(full_config().hift).cuda().eval().requires_grad_(False)

    hift = build_hift()
    g = torch.Generator().manual_seed(0)
    mels = {n: (torch.randn(16, 80, n, generator=g) - 5).cuda() for n in (*LENGTHS, 56)}
    empty = torch.zeros(16, 1, 0, device="cuda")

    def gen(i: int = 0) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(1 + i)

    def by_name(call) -> dict:  # noqa: ANN001
        names: dict = {}
        for name, us in kernel_times(call):
            entry = names.setdefault(name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] = round(entry[1] + us, 1)
        return names

    def chunk() -> dict:
        vocs = {m: build(m == "triton", (1,), LENGTHS) for m in MODES}
        ref = hift.remove_weight_norm().eval()
        r: dict = {"kernels": {}, "kernel_names": {}, "error_vs_fp32": {}, "f0_diff": {}}

        def call(mode: str, n: int):  # noqa: ANN202
            return lambda: vocs[mode].vocode(mels[n][:1], empty[:1], gen())

        with torch.inference_mode():
            for n in LENGTHS:
                f0 = {m: vocs[m]._f0(mels[n][:1]) for m in MODES}
                r["f0_diff"][str(n)] = (f0["triton"] - f0["cudnn"]).abs().max().item()
                for m in MODES:
                    wav, src = call(m, n)()
                    saved = torch.backends.cudnn.allow_tf32
                    torch.backends.cudnn.allow_tf32 = False
                    try:
                        want = ref.decode(mels[n][:1], src)
                    finally:
                        torch.backends.cudnn.allow_tf32 = saved
                    err = (wav - want).double()
                    snr = 10 * math.log10(want.double().pow(2).mean().item() / max(err.pow(2).mean().item(), 1e-30))
                    r["error_vs_fp32"][f"{m}_{n}"] = {"max": err.abs().max().item(), "mean": err.abs().mean().item(),
                                                     "snr_db": round(snr, 2)}
                    r["kernels"][f"{m}_{n}"] = count_kernels(call(m, n))
                    if n == LENGTHS[0]:
                        r["kernel_names"][m] = by_name(call(m, n))
            r.update(alternating_rounds({str(n): n for n in LENGTHS}, MODES,
                                        lambda n, m: time_call(call(m, n), warmup=3, iters=50)["median_ms"]))
        return r

    def rows() -> dict:
        vocs = {m: build(m == "triton", (4, 16), (56,)) for m in MODES}

        def call(mode: str, b: int):  # noqa: ANN202
            return lambda: vocs[mode].vocode_batch(mels[56][:b], empty[:b], [gen(i) for i in range(b)])

        with torch.inference_mode():
            r = {"kernels": {f"{m}_{b}": count_kernels(call(m, b)) for m in MODES for b in (4, 16)}}
            r.update(alternating_rounds({str(b): b for b in (4, 16)}, MODES,
                                        lambda b, m: time_call(call(m, b), warmup=3, iters=30)["median_ms"]))
        return r

    def build(triton_convs: bool, rows: tuple[int, ...], lengths: tuple[int, ...], **setting) -> FusedVocoder:
        """A vocoder captured under ``setting`` (module globals of hift_conv; the Triton one for any rows)."""
        saved = hift_conv.MIN_PROGRAMS, dict(hift_conv.LAUNCH), dict(hift_conv.TILES)
        hift_conv.MIN_PROGRAMS = setting.pop("min_programs", hift_conv.MIN_PROGRAMS)
        hift_conv.LAUNCH.update(max_rows=64, pdl=setting.pop("pdl", hift_conv.LAUNCH["pdl"]))
        hift_conv.TILES.update(setting)
        try:
            return FusedVocoder(hift, rows=rows, lengths=lengths, progress=False, triton_convs=triton_convs)
        finally:
            hift_conv.MIN_PROGRAMS = saved[0]
            hift_conv.LAUNCH.clear()
            hift_conv.LAUNCH.update(saved[1])
            hift_conv.TILES.clear()
            hift_conv.TILES.update(saved[2])

    def tiles() -> dict:
        one = {"default": {}, "narrow64": {"bci_narrow": 64}, "min66": {"min_programs": 66},
               "min264": {"min_programs": 264}, "stages2": {"stages": 2}, "stages4": {"stages": 4}}
        many = {"default": {}, "bci32": {"bci": 32}, "bt64": {"bt": 64}, "bt64_bci32": {"bt": 64, "bci": 32},
                "warps8": {"warps": 8}, "stages2": {"stages": 2}, "stages4": {"stages": 4}, "cudnn": None}
        r = {}
        vocs = {k: build(True, (1,), (50,), **v) for k, v in one.items()}
        with torch.inference_mode():
            r["one_row_50"] = alternating_rounds({"50": 50}, tuple(one), lambda n, s: time_call(
                lambda: vocs[s].vocode(mels[n][:1], empty[:1], gen()), warmup=3, iters=50)["median_ms"])
        if "rows16" not in steps:
            return r
        vocs = {k: build(v is not None, (16,), (56,), **(v or {})) for k, v in many.items()}
        with torch.inference_mode():
            r["rows16_56"] = alternating_rounds({"16": 16}, tuple(many), lambda b, s: time_call(
                lambda: vocs[s].vocode_batch(mels[56][:b], empty[:b], [gen(i) for i in range(b)]),
                warmup=2, iters=20)["median_ms"])
        return r

    for name, fn in (("chunk", chunk), ("rows", rows), ("tiles", tiles)):
        if name in steps:
            runner.run(name, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
