"""One GPU run: the estimator's GEMMs at many rows, cuBLAS + epilogue pass against the tall Triton kernel.

    PYTHONUNBUFFERED=1 python benchmarks/estimator_tall_gemm.py --out $OUT/estimator_tall_gemm.json

Full-size estimator (CosyVoice2 DecoderConfig), seeded random weights, bf16.
1. ``gemms``: each GEMM kind of a transformer block (q/k/v; out-projection + residual + next LayerNorm; FF1 +
   GELU; FF2 + residual + next LayerNorm; FF2 + residual) at the row counts batched solves produce
   (8 x 206, 16 x 250, 32 x 250, 32 x 450 frames): µs per call of the path ``linear`` takes with the shipped
   settings, of ``torch.mm`` alone (the product without its epilogue), and of
   :func:`~cosyvoice_fast.flow.kernels.estimator_tall.linear_tall` for a handful of tile settings.
2. ``ffn``: the feed-forward half of a block with the next LayerNorm as one kernel
   (:func:`~cosyvoice_fast.flow.kernels.estimator_linear.ffn`) per tile setting of :data:`FFN`, against the two
   GEMMs the many-rows path runs without it.
3. ``pick``: the tile settings with the least time summed over the kinds (weighted by calls per forward).
4. ``forward``: graph-replay ms of one fused forward from 2 x 206 to 32 x 450 frames under each of
   :data:`SETTINGS` (which kernel computes the many-rows products, from how many rows, the convs' large tiles
   from how many rows), and the bf16 output's largest difference from the first setting's.
5. ``kernels``: the GPU time of one forward at 32 x 250 and 8 x 206 by kernel name, shipped settings.
Every step runs under a time limit; the JSON is rewritten after each step (:mod:`benchmarks.steps`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.estimator_rows_sweep import by_name  # noqa: E402
from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.config.model import CFMConfig, DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels import estimator_cublas, estimator_linear, estimator_tall  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_linear import ACT_GELU, ACT_NONE, linear  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import estimator_flops, estimator_inputs, graph_replay_ms, kernel_times
from cosyvoice_fast.flow.model.cfm import CausalCFM  # noqa: E402

#: (bm, bn, bk, warps, stages) of launches without the whole-row LayerNorm
PLAIN = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 3),
         (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3),
         (128, 128, 128, 8, 2)]
#: (bm, bk, warps, stages) of launches that also write the next LayerNorm (bn = the row)
NORM = [(64, 64, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (128, 32, 8, 4)]
ROWS = {"8x206": 8 * 206, "16x250": 16 * 250, "32x250": 32 * 250, "32x450": 32 * 450}
#: (K, N, bias, act, residual, next LayerNorm, calls per forward of the released estimator)
KINDS = {"qkv": (256, 768, False, ACT_NONE, False, False, 56),
         "out_norm": (256, 256, True, ACT_NONE, True, True, 56),
         "ff1_gelu": (256, 1024, True, ACT_GELU, False, False, 56),
         "ff2_norm": (1024, 256, True, ACT_NONE, True, True, 42),
         "ff2": (1024, 256, True, ACT_NONE, True, False, 14)}
#: forward settings: (product on the many-rows path, its first row count, the convs' LARGE_M, whether the
#: estimator runs ``ffn_one_kernel``); "cublas_2048" is how the code ran before the tall kernel (session 9)
SETTINGS = {"cublas_2048": ("cublas", 2048, 2048, False), "cublas_1024": ("cublas", 1024, 2048, False),
            "auto_2048": ("auto", 2048, 2048, False), "auto_1024": ("auto", 1024, 2048, False),
            "auto_1024_conv": ("auto", 1024, 1024, False), "auto_768": ("auto", 768, 2048, False),
            "auto_512": ("auto", 512, 2048, False), "auto_512_conv": ("auto", 512, 512, False),
            "auto_384": ("auto", 384, 2048, False), "auto_256": ("auto", 256, 2048, False),
            "tall_1024": ("triton", 1024, 2048, False), "auto_512_ffn": ("auto", 512, 2048, True)}
#: (bm, bh, warps, stages) of the one-kernel feed-forward (:func:`~cosyvoice_fast.flow.kernels.estimator_linear.ffn`)
FFN = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2),
       (64, 32, 4, 3), (64, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2)]
#: forward shapes: rows x frames, "f" for full attention (the final chunk), else chunk-causal
SHAPES = "2x206,4x206,4x300,8x206,8x300,16x250,32x250,32x450f"
REPS = 10  # launches per captured graph: the per-call time is replay / REPS


def forward_shapes(spec: str) -> list[tuple[int, int, bool]]:
    """``"2x206,32x450f"`` -> [(rows, frames, chunk-causal?)]: a trailing ``f`` marks full attention."""
    return [(int(r), int(f.rstrip("f")), not f.endswith("f"))
            for r, f in (s.strip().split("x") for s in spec.split(","))]


def tile_settings(name: str, norm: bool) -> dict:
    """The ``linear_tall`` tiles named ``bm x bn x bk x warps x stages`` (:data:`PLAIN`) or, for the launches
    that write the next LayerNorm, ``bm x bk x warps x stages`` (:data:`NORM`; the column tile is the row)."""
    keys = ("bm", "bk", "warps", "stages") if norm else ("bm", "bn", "bk", "warps", "stages")
    return dict(zip(keys, map(int, name.split("x"))))


def pick_tiles(table: dict) -> dict:
    """Per tile family (plain, norm): each setting's µs summed over the GEMM kinds of that family at the batched
    row counts, weighted by calls per forward (NaN where a kind lacks a time: the tile failed to compile or
    run), and the setting with the least."""
    best = {}
    for norm, cfgs in ((False, PLAIN), (True, NORM)):
        totals = {}
        for cfg in cfgs:
            name = "x".join(map(str, cfg))
            times = [(spec[6], table.get(f"{kind}@{label}", {}).get(name))
                     for kind, spec in KINDS.items() if spec[5] == norm for label in ("16x250", "32x250", "32x450")]
            ok = all(isinstance(v, float) for _, v in times)
            totals[name] = round(sum(c * v for c, v in times), 1) if ok else float("nan")
        timed = {k: v for k, v in totals.items() if v == v}
        best["norm" if norm else "plain"] = {"totals_us": totals, "best": min(timed, key=timed.get) if timed else None}
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-timeout", type=int, default=240)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=SHAPES, help="forward shapes, e.g. 2x206,32x450f")
    ap.add_argument("--settings", default="cublas_2048,auto_1024,auto_768,auto_512,auto_512_conv,tall_1024",
                    help=f"forward settings, of: {', '.join(SETTINGS)}")
    ap.add_argument("--steps", default="gemms,pick,forward,kernels",
                    help="comma-separated steps to run (forward and kernels use the picked tiles when pick ran)")
    args = ap.parse_args()
    require_cuda("estimator_tall_gemm.py")
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    runner = StepRunner(args.out, res, step_timeout=args.step_timeout, echo_chars=800)
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, bf)

    def per_call_us(fn) -> float:  # noqa: ANN001
        return round(1000 * graph_replay_ms(lambda: [fn() for _ in range(REPS)], iters=args.iters) / REPS, 2)

    def gemms() -> dict:
        r: dict = {}
        with torch.inference_mode():
            for kind, (k, n, has_b, act, has_r, norm, _) in KINDS.items():
                w, b, gam, beta = rnd(n, k, scale=k ** -0.5), rnd(n), rnd(n), rnd(n)
                for label, m in ROWS.items():
                    x, res_ = rnd(m, k), rnd(m, n)
                    out, normed = torch.empty(m, n, device=dev, dtype=bf), torch.empty(m, n, device=dev, dtype=bf)
                    bias, resid = (b if has_b else None), (res_ if has_r else None)
                    # the forward passes norm_out only where the many-rows path takes the call
                    many = estimator_cublas.use_many_rows(m, w, 0)
                    fwd_norm = (normed, (gam, beta, 1e-5)) if norm and many else None
                    e = {"linear": per_call_us(lambda: linear(  # noqa: B023
                        x, w, bias, act=act, residual=resid, out=out, norm_out=fwd_norm)),  # noqa: B023
                         "mm_only": per_call_us(lambda: torch.mm(x, w.t(), out=out))}  # noqa: B023
                    nrm = (normed, (gam, beta, 1e-5)) if norm else None
                    for cfg in (NORM if norm else PLAIN):
                        name = "x".join(map(str, cfg))
                        tiles = tile_settings(name, norm)
                        try:
                            e[name] = per_call_us(lambda: estimator_tall.linear_tall(  # noqa: B023
                                x, w, bias, act=act, residual=resid, rowmask=None, out=out, rows_per_b=m,  # noqa: B023
                                out_strides=(0, n, 1), norm_out=nrm, tiles=tiles))  # noqa: B023
                        except Exception as ex:  # noqa: BLE001 - a tile that does not fit must not hide the rest
                            e[name] = f"{type(ex).__name__}: {ex}"[:160]
                    # correctness of the last tile setting against the fp32 product (bf16 rounding level)
                    ref = torch.mm(x.float(), w.float().t()) + (b.float() if has_b else 0)
                    ref = torch.nn.functional.gelu(ref) if act == ACT_GELU else ref
                    ref = ref + (res_.float() if has_r else 0)
                    e["max_err_vs_fp32"] = round((out.float() - ref).abs().max().item(), 4)
                    r[f"{kind}@{label}"] = e
                    print(kind, label, e, flush=True)
                    runner.save()
        return r

    def ffn_step() -> dict:
        """The feed-forward half (+ the next LayerNorm) as one kernel per tile setting, against the two GEMMs
        the many-rows path runs today (FF1 + GELU, then FF2 + residual + next LayerNorm)."""
        r: dict = {}
        k, hdim = 256, 1024
        w1, b1, w2, b2 = rnd(hdim, k, scale=k ** -0.5), rnd(hdim), rnd(k, hdim, scale=hdim ** -0.5), rnd(k)
        g1, be1, g2, be2 = rnd(k), rnd(k), rnd(k), rnd(k)
        with torch.inference_mode():
            for label, m in ROWS.items():
                x = rnd(m, k)
                n3, hid = torch.empty(m, k, device=dev, dtype=bf), torch.empty(m, hdim, device=dev, dtype=bf)
                out, normed = torch.empty(m, k, device=dev, dtype=bf), torch.empty(m, k, device=dev, dtype=bf)

                n3.copy_(torch.nn.functional.layer_norm(x, (k,), g1, be1, 1e-5))

                def two_gemms() -> None:  # n3 = norm3(x) comes from the out-projection's epilogue
                    linear(n3, w1, b1, act=ACT_GELU, out=hid)  # noqa: B023
                    linear(hid, w2, b2, residual=x, out=out, norm_out=(normed, (g2, be2, 1e-5)))  # noqa: B023

                e: dict = {"two_gemms": per_call_us(two_gemms)}
                for cfg in FFN:
                    name = "x".join(map(str, cfg))
                    tiles = dict(zip(("bm", "bh", "warps", "stages"), cfg))
                    try:
                        e[name] = per_call_us(lambda: estimator_linear.ffn(  # noqa: B023
                            x, (g1, be1, 1e-5), w1, b1, w2, b2, out=out,  # noqa: B023
                            norm_out=(normed, (g2, be2, 1e-5)), tiles=tiles))  # noqa: B023
                    except Exception as ex:  # noqa: BLE001 - a tile that does not fit must not hide the rest
                        e[name] = f"{type(ex).__name__}: {ex}"[:160]
                ln = torch.nn.functional.layer_norm(x.float(), (k,), g1.float(), be1.float(), 1e-5).to(bf).float()
                ref = x.float() + torch.nn.functional.linear(torch.nn.functional.gelu(
                    torch.nn.functional.linear(ln, w1.float(), b1.float())).to(bf).float(), w2.float(), b2.float())
                e["max_err_vs_fp32"] = round((out.float() - ref).abs().max().item(), 4)
                r[label] = e
                print("ffn", label, e, flush=True)
                runner.save()
        return r

    def pick() -> dict:
        return pick_tiles(res.get("gemms") or {})

    def apply_pick() -> None:
        for key, tiles in (("plain", estimator_tall.TILES), ("norm", estimator_tall.NORM_TILES)):
            best = (res.get("pick") or {}).get(key, {}).get("best")
            if best:
                tiles.update(tile_settings(best, norm=key == "norm"))

    torch.manual_seed(0)
    est = CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval().to(bf).estimator
    est.fuse_projections()
    fused = FusedEstimator(est)
    fused_ffn = FusedEstimator(est, ffn_one_kernel=True)
    cfg = est.cfg

    def forward() -> dict:
        apply_pick()
        r = {"tiles": dict(estimator_tall.TILES), "norm_tiles": dict(estimator_tall.NORM_TILES)}
        saved = estimator_cublas.MANY_ROWS["product"], estimator_cublas.MANY_ROWS_M, estimator_linear.LARGE_M
        shapes = forward_shapes(args.shapes)
        try:
            with torch.inference_mode():
                for rows, frames, streaming in shapes:
                    a = estimator_inputs(cfg, rows, frames, bf)
                    gflop = estimator_flops(cfg, rows, frames, streaming) / 1e9
                    ref = None
                    for name in (n.strip() for n in args.settings.split(",")):
                        product, threshold, conv_large, one_ffn = SETTINGS[name]
                        estimator_cublas.MANY_ROWS["product"] = product
                        estimator_cublas.MANY_ROWS_M = threshold
                        estimator_linear.LARGE_M = conv_large
                        f = fused_ffn if one_ffn else fused
                        y = f(*a, streaming).float()
                        ref = y if ref is None else ref
                        ms = graph_replay_ms(lambda: f(*a, streaming), iters=args.iters)  # noqa: B023
                        r[f"{name}_{rows}x{frames}{'' if streaming else '_full'}"] = {
                            "ms": round(ms, 3), "tflops": round(gflop / ms, 1),
                            "max_diff_vs_first": round((y - ref).abs().max().item(), 4)}
                    print(rows, frames, {k: v for k, v in r.items() if f"_{rows}x{frames}" in k}, flush=True)
                    runner.save()
        finally:
            estimator_cublas.MANY_ROWS["product"], estimator_cublas.MANY_ROWS_M, estimator_linear.LARGE_M = saved
        return r

    def kernels() -> dict:
        apply_pick()
        r = {}
        with torch.inference_mode():
            for rows, frames in ((32, 250), (8, 206)):
                a = estimator_inputs(cfg, rows, frames, bf)
                fused(*a, True)
                r[f"{rows}x{frames}"] = by_name(kernel_times(lambda: fused(*a, True)))  # noqa: B023
        return r

    steps = {"gemms": lambda: runner.run("gemms", gemms, timeout=max(args.step_timeout, 300)),
             "ffn": lambda: runner.run("ffn", ffn_step),
             "pick": lambda: runner.run("pick", pick), "forward": lambda: runner.run("forward", forward),
             "kernels": lambda: runner.run("kernels", kernels)}
    for name in args.steps.split(","):
        steps[name.strip()]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
