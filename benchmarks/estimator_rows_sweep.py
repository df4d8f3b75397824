"""One GPU run: the flow estimator at the row counts a batched solve uses (16 requests x CFG pair = 32 rows).

    PYTHONUNBUFFERED=1 python benchmarks/estimator_rows_sweep.py --out $OUT/estimator_rows_sweep.json

Full-size estimator (CosyVoice2 DecoderConfig), seeded random weights, bf16, chunk-causal attention.
1. graph-replay ms of one forward, ``cudagraph`` (the eager estimator captured) and ``fused``, at 2 / 8 / 16 / 32
   rows of 250 frames (the length bucket of a first chunk: prompt 75 + 28 tokens = 206 frames);
2. the GPU time of one forward at 32 rows by kernel name, both backends (where the time goes);
3. the fused forward at 8 / 16 / 32 rows for a handful of named settings of the large-row path (conv
   ``TUNING_LARGE``, ``ATTN_TUNING``, cuBLAS GEMMs on or off), and the bf16 output of each against the
   default's (tiles change only the order of fp32 accumulation, cuBLAS adds one bf16 rounding of the product).
Every step runs under a time limit; the JSON is rewritten after each step (:mod:`benchmarks.steps`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.config.model import CFMConfig, DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels import estimator_attention, estimator_conv, estimator_cublas  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import estimator_flops, estimator_inputs, graph_replay_ms, kernel_times
from cosyvoice_fast.flow.model.cfm import CausalCFM  # noqa: E402

_CONV_SMALL = dict(estimator_conv.TUNING)
# (conv TUNING_LARGE, ATTN_TUNING, the many-rows GEMM path from MANY_ROWS_M rows) per named setting: a handful
VARIANTS = {
    "default": ({}, {}, True),
    "no_cublas": ({}, {}, False),
    "conv_small_tiles": (_CONV_SMALL, {}, True),
    "conv_m128_n128": ({"bm": 128, "bn": 128, "bk": 64, "warps": 8, "ln_bm": 64, "ln_warps": 8, "stages": 3}, {}, True),
    "conv_ln_bm64": ({"ln_bm": 64, "ln_warps": 8}, {}, True),
    "attn_m128_w8": ({}, {"bm": 128, "bn": 64, "warps": 8}, True),
    "attn_m64_n32": ({}, {"bm": 64, "bn": 32, "warps": 4}, True),
    "attn_m32_n64": ({}, {"bm": 32, "bn": 64, "warps": 4}, True),
}


def by_name(kt: list[tuple[str, float]], top: int = 14) -> dict:
    agg: dict[str, list] = {}
    for name, us in kt:
        e = agg.setdefault(name[:60], [0, 0.0])
        e[0] += 1
        e[1] += us
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kt), "sum_us": round(sum(us for _, us in kt), 1),
            "top_count_us": {k: [v[0], round(v[1], 1)] for k, v in rows}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-timeout", type=int, default=150)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--frames", type=int, default=250)
    args = ap.parse_args()
    require_cuda("estimator_rows_sweep.py")
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "frames": args.frames,
                 "triton": triton.__version__}
    runner = StepRunner(args.out, res, step_timeout=args.step_timeout, echo_chars=600)

    torch.manual_seed(0)
    est = CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval().to(torch.bfloat16).estimator
    est.fuse_projections()
    fused = FusedEstimator(est)
    cfg, n = est.cfg, args.frames

    def timing() -> dict:
        r = {}
        with torch.inference_mode():
            for rows in (2, 8, 16, 32):
                a = estimator_inputs(cfg, rows, n, torch.bfloat16)
                gflop = estimator_flops(cfg, rows, n, True) / 1e9
                for name, mod in (("cudagraph", est), ("fused", fused)):
                    ms = graph_replay_ms(lambda: mod(*a, True), iters=args.iters)  # noqa: B023
                    r[f"{name}_rows{rows}"] = {"ms": round(ms, 3), "tflops": round(gflop / ms, 1)}
        return r

    def kernels(name: str, mod) -> dict:  # noqa: ANN001
        a = estimator_inputs(cfg, 32, n, torch.bfloat16)
        with torch.inference_mode():
            mod(*a, True)
            return by_name(kernel_times(lambda: mod(*a, True)))

    def variants() -> dict:
        r = {}
        tables = (estimator_conv.TUNING_LARGE, estimator_attention.ATTN_TUNING)
        saved = [dict(d) for d in tables]
        cublas_m = estimator_cublas.MANY_ROWS_M
        refs = {}
        with torch.inference_mode():
            for vname, (conv, attn, cublas) in VARIANTS.items():
                for d, base, o in zip(tables, saved, (conv, attn)):
                    d.clear()
                    d.update(base)
                    d.update(o)
                estimator_cublas.MANY_ROWS_M = cublas_m if cublas else 1 << 40
                try:
                    for rows in (8, 16, 32):
                        a = estimator_inputs(cfg, rows, n, torch.bfloat16)
                        y = fused(*a, True).float()
                        if rows not in refs:
                            refs[rows] = y
                        err = (y - refs[rows]).abs().max().item()
                        ms = graph_replay_ms(lambda: fused(*a, True), iters=args.iters)  # noqa: B023
                        r[f"{vname}_rows{rows}"] = {"ms": round(ms, 3), "max_diff_vs_default": err}
                except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                    r[vname] = f"{type(e).__name__}: {e}"[:300]
                print(vname, {k: v for k, v in r.items() if k.startswith(vname)}, flush=True)
        for d, base in zip(tables, saved):
            d.clear()
            d.update(base)
        estimator_cublas.MANY_ROWS_M = cublas_m
        return r

    runner.run("timing_ms", timing)
    runner.run("kernels_cudagraph_rows32", lambda: kernels("cudagraph", est))
    runner.run("kernels_fused_rows32", lambda: kernels("fused", fused))
    # each variant compiles its own kernel set: more time than a timing step
    runner.run("variants_large", variants, timeout=max(args.step_timeout, 200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
