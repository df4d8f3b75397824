"""One GPU run: the estimator's attention kernel over tile settings, at the shapes batched solves produce.

    PYTHONUNBUFFERED=1 python benchmarks/estimator_attention_sweep.py --out $OUT/estimator_attention_sweep.json

Full-size estimator heads (8 x 64), bf16, seeded random q/k/v.
1. ``kernel``: µs per call of :func:`~cosyvoice_fast.flow.kernels.estimator_attention.attention` at each of
   :data:`SHAPES` (rows x frames, chunk-causal with the 50-frame chunk or full) with the shipped tiles and with
   every setting of :func:`variants`; ``torch`` SDPA beside it (flash for full attention without padding, the
   dense-mask kernel for chunk-causal), TFLOP/s over the visible (query, key) pairs, and each setting's largest
   difference from the shipped output (fp32 accumulation in another order: bf16 rounding).
2. ``sdpa``: torch's SDPA backends (flash, memory-efficient, cuDNN) at ``--kernel-shapes`` with every other row
   padded (a key-padding or dense chunk mask), against the kernel: whether any could replace it.
3. ``pick``: per shape the fastest setting; per attention mode and over all shapes the setting with the least
   time summed (weighted by :data:`SHAPES`' weights).
4. ``forward``: graph-replay ms of one fused estimator forward at ``--shapes`` with the shipped tiles and with the
   pick over all shapes (``--apply`` names another setting), and the output's largest difference.
Every step runs under a time limit; the JSON is rewritten after each step (:mod:`benchmarks.steps`).
"""

from __future__ import annotations

import argparse
import sys
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.estimator_tall_gemm import forward_shapes  # noqa: E402
from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.config.model import CFMConfig, DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels import estimator_attention as ea  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import estimator_inputs, graph_replay_ms  # noqa: E402
from cosyvoice_fast.flow.model.cfm import CausalCFM  # noqa: E402
from cosyvoice_fast.flow.model.decoder import attention_allowed  # noqa: E402

HEADS, HEAD_DIM, CHUNK = 8, 64, 50
#: name -> (batch rows, frames, chunk-causal?, weight in the pick: how much of a c64 wave's attention it is)
SHAPES = {"2x206": (2, 206, True, 1), "8x206": (8, 206, True, 1), "32x200": (32, 200, True, 2),
          "32x300": (32, 300, True, 2), "2x450f": (2, 450, False, 1), "16x450f": (16, 450, False, 1),
          "32x450f": (32, 450, False, 3)}
REPS = 10  # launches per captured graph


def setting_name(t: dict) -> str:
    return f"{t['bm']}x{t['bn']}x{t['warps']}x{t['stages']}"


def parse_setting(name: str) -> dict:
    """The tiles of a :func:`setting_name` (``bm x bn x warps x stages``)."""
    return dict(zip(("bm", "bn", "warps", "stages"), map(int, name.split("x"))))


def variants() -> list[dict]:
    """Every (bm, bn, warps, stages) of a small grid (32-row query tiles with 4 warps only)."""
    return [{"bm": bm, "bn": bn, "warps": w, "stages": st}
            for bm, bn, w, st in product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
            if not (bm == 32 and w == 8)]


def visible_pairs(frames: int, chunk: int) -> int:
    """(query, key) pairs one head of one row computes usefully: each query sees keys up to its chunk's end."""
    if not chunk:
        return frames * frames
    return sum(min((i // chunk + 1) * chunk, frames) for i in range(frames))


def pick_settings(table: dict) -> dict:
    """Per shape the fastest setting; per mode (chunk-causal, full) and over all shapes the setting with the
    least weighted sum (over shapes where every setting ran)."""
    best: dict = {"per_shape": {}}
    for key, modes in (("chunk", (True,)), ("full", (False,)), ("all", (True, False))):
        names = [n for n, s in SHAPES.items() if s[2] in modes and n in table]
        totals: dict = {}
        for n in names:
            timed = {k: v for k, v in table[n]["us"].items() if isinstance(v, float) and not k.startswith("sdpa")}
            best["per_shape"][n] = min(timed, key=timed.get) if timed else None
            for k, v in timed.items():
                totals.setdefault(k, []).append(SHAPES[n][3] * v)
        done = {k: round(sum(v), 1) for k, v in totals.items() if len(v) == len(names)}
        best[key] = {"best": min(done, key=done.get) if done else None,
                     "shipped_total": done.get("shipped"), "best_total": min(done.values()) if done else None}
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-timeout", type=int, default=300)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="2x206,8x206,32x250,32x300,2x450f,32x450f", help="forward shapes")
    ap.add_argument("--apply", default="", help="forward: this setting instead of the pick over all shapes")
    ap.add_argument("--steps", default="kernel,sdpa,pick,forward")
    ap.add_argument("--variants", default="all", help="'all' (:func:`variants`) or setting names, comma-separated")
    ap.add_argument("--kernel-shapes", default=",".join(SHAPES), help=f"of: {', '.join(SHAPES)}")
    args = ap.parse_args()
    require_cuda("estimator_attention_sweep.py")
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    runner = StepRunner(args.out, res, step_timeout=args.step_timeout, echo_chars=800)
    dev, bf = "cuda", torch.bfloat16
    shipped = dict(ea.ATTN_TUNING)
    res["shipped"] = shipped

    def per_call_us(fn) -> float:  # noqa: ANN001
        return round(1000 * graph_replay_ms(lambda: [fn() for _ in range(REPS)], iters=args.iters) / REPS, 2)

    settings = variants() if args.variants == "all" else [parse_setting(n.strip()) for n in args.variants.split(",")]

    def kernel() -> dict:
        r: dict = res.setdefault("kernel_partial", {})  # kept on disk shape by shape, should the step time out
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.inference_mode():
            for name in args.kernel_shapes.split(","):
                rows, frames, streaming, _ = SHAPES[name]
                chunk = CHUNK if streaming else 0
                qkv = torch.randn(rows * frames, 3 * HEADS * HEAD_DIM, generator=g).to(dev, bf)
                mask = torch.ones(rows * frames, device=dev, dtype=bf)
                out = torch.empty(rows * frames, HEADS * HEAD_DIM, device=dev, dtype=bf)
                ref = ea.attention(qkv, mask, rows, HEADS, HEAD_DIM, chunk).float()
                e: dict = {"shipped": per_call_us(lambda: ea.attention(  # noqa: B023
                    qkv, mask, rows, HEADS, HEAD_DIM, chunk, out=out))}  # noqa: B023
                diffs = {}
                for t in settings:
                    k = setting_name(t)
                    try:
                        e[k] = per_call_us(lambda: ea.attention(  # noqa: B023
                            qkv, mask, rows, HEADS, HEAD_DIM, chunk, out=out, tiles=t))  # noqa: B023
                        diffs[k] = round((out.float() - ref).abs().max().item(), 4)
                    except Exception as ex:  # noqa: BLE001 - a tile that does not fit must not hide the rest
                        e[k] = f"{type(ex).__name__}: {ex}"[:160]
                q, kk, v = qkv.view(rows, frames, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
                allowed = attention_allowed(mask.view(rows, 1, frames), chunk).unsqueeze(1)
                if streaming:
                    e["sdpa_dense_mask"] = per_call_us(lambda: F.scaled_dot_product_attention(  # noqa: B023
                        q, kk, v, attn_mask=allowed))  # noqa: B023
                else:
                    e["sdpa_flash"] = per_call_us(lambda: F.scaled_dot_product_attention(q, kk, v))  # noqa: B023
                flop = 4 * rows * HEADS * HEAD_DIM * visible_pairs(frames, chunk)
                timed = {k: v for k, v in e.items() if isinstance(v, float)}
                r[name] = {"us": e, "max_diff_vs_shipped": diffs,
                           "tflops": {k: round(flop / (v * 1e6), 1) for k, v in timed.items()}}
                top = sorted(timed.items(), key=lambda kv: kv[1])[:5]
                print(name, "shipped", e["shipped"], "best", top, flush=True)
                runner.save()
        return r

    def sdpa() -> dict:
        """torch's SDPA backends at the many-rows shapes, with a key-padding mask where rows are padded (the
        last 13 frames of every other row): which could replace the kernel where, and at what cost."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        r: dict = {}
        g = torch.Generator(device="cpu").manual_seed(1)
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION}
        with torch.inference_mode():
            for name in args.kernel_shapes.split(","):
                rows, frames, streaming, _ = SHAPES[name]
                chunk = CHUNK if streaming else 0
                qkv = torch.randn(rows * frames, 3 * HEADS * HEAD_DIM, generator=g).to(dev, bf)
                q, kk, v = qkv.view(rows, frames, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
                mask = torch.ones(rows, frames, device=dev, dtype=bf)
                mask[::2, frames - 13:] = 0
                ours = ea.attention(qkv, mask.reshape(-1), rows, HEADS, HEAD_DIM, chunk).float()
                allowed = attention_allowed(mask.view(rows, 1, frames), chunk).unsqueeze(1)  # (B, 1, T|1, T)
                e: dict = {"ours": per_call_us(lambda: ea.attention(  # noqa: B023
                    qkv, mask.reshape(-1), rows, HEADS, HEAD_DIM, chunk))}  # noqa: B023
                for label, be in backends.items():
                    for mname, m in (("none", None), ("mask", allowed)):
                        if m is None and (streaming or label != "flash"):
                            continue
                        try:
                            with sdpa_kernel([be]):
                                fn = lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=m)  # noqa: B023,E731
                                y = fn().transpose(1, 2).reshape(rows * frames, -1).float()
                                e[f"{label}_{mname}"] = per_call_us(fn)
                            valid = mask.reshape(-1) != 0
                            if m is not None:
                                e[f"{label}_{mname}_diff"] = round((y - ours)[valid].abs().max().item(), 4)
                        except Exception as ex:  # noqa: BLE001 - a backend that refuses must not hide the rest
                            e[f"{label}_{mname}"] = f"{type(ex).__name__}: {ex}"[:120]
                r[name] = e
                print("sdpa", name, e, flush=True)
                runner.save()
        return r

    def pick() -> dict:
        return pick_settings(res.get("kernel") or res.get("kernel_partial") or {})

    torch.manual_seed(0)
    est = CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval().to(bf).estimator
    est.fuse_projections()
    fused = FusedEstimator(est)
    cfg = est.cfg

    def forward() -> dict:
        chosen = args.apply or (res.get("pick") or {}).get("all", {}).get("best") or "shipped"
        r: dict = {"applied": chosen}
        shapes = forward_shapes(args.shapes)
        try:
            with torch.inference_mode():
                for rows, frames, streaming in shapes:
                    a = estimator_inputs(cfg, rows, frames, bf)
                    ref = None
                    for label in ("shipped", "picked"):
                        ea.ATTN_TUNING.clear()
                        ea.ATTN_TUNING.update(shipped if label == "shipped" or chosen == "shipped"
                                              else parse_setting(chosen))
                        y = fused(*a, streaming).float()
                        ref = y if ref is None else ref
                        ms = graph_replay_ms(lambda: fused(*a, streaming), iters=args.iters)  # noqa: B023
                        r[f"{label}_{rows}x{frames}{'' if streaming else '_full'}"] = {
                            "ms": round(ms, 3), "max_diff_vs_shipped": round((y - ref).abs().max().item(), 4)}
                    print(rows, frames, {k: v for k, v in r.items() if f"_{rows}x{frames}" in k}, flush=True)
                    runner.save()
        finally:
            ea.ATTN_TUNING.clear()
            ea.ATTN_TUNING.update(shipped)
        return r

    steps = {"kernel": lambda: runner.run("kernel", kernel, timeout=max(args.step_timeout, 300)),
             "sdpa": lambda: runner.run("sdpa", sdpa), "pick": lambda: runner.run("pick", pick),
             "forward": lambda: runner.run("forward", forward)}
    for name in args.steps.split(","):
        steps[name.strip()]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
