"""Micro-benchmark of CosyVoice3's DiT estimator forward: eager vs CUDA graph, PyTorch modules vs the captured
cuBLAS + Triton DiT, read against the GPU's peak.

``python -m cosyvoice_fast.bench.dit_profile --out dit.json`` builds a DiT of the given sizes (default the real
Fun-CosyVoice3-0.5B: dim 1024, 22 blocks, 16 heads x 64, ff x2) with synthetic random weights, and times one
forward of the CFG pair (2 rows x 112 frames, bf16), for each variant (``eager``: the PyTorch modules, what the
``cudagraph`` stage captured before; ``cudagraph``: :class:`~cosyvoice_fast.flow.kernels.dit_blas.BlasDiT`, what the
``cudagraph`` and ``fused`` stages capture now; the all-Triton DiT that was ``fused`` lost, docs/VARIANTS.md):

* ``direct_ms``: the module called directly, no graph (CUDA events around ``iters`` warm calls, mean);
* ``graph_ms``: the forward as a raw CUDA-graph replay (:func:`~cosyvoice_fast.bench.estimator_profile.
  graph_profile`: also its kernel count and the top kernels by GPU time);
* ``runner_ms``: what the ``cudagraph`` flow stage pays per forward (:class:`~cosyvoice_fast.flow.graph.
  GraphEstimator`: inputs copied in, replay, output cloned);
* ``solve_step_ms``: one Euler step of a whole replayed guided solve (forward + CFG mix + update), per step.

FLOPs are counted from the shapes (:func:`dit_forward_flops`: GEMMs, attention, the grouped position convs) and
reported as TFLOP/s against ``--peak-tflops`` (990: the H100 SXM's dense bf16 tensor-core peak).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from cosyvoice_fast.config.dit import DiTConfig, DiTFlowConfig

H100_BF16_TFLOPS = 990.0
#: the estimator modules timed: PyTorch modules, the graph stages' BlasDiT
VARIANTS = ("eager", "cudagraph")


def _module(name: str, est: torch.nn.Module, n_steps: int) -> torch.nn.Module:
    """The estimator module a variant times (``eager``: the DiT itself)."""
    if name == "cudagraph":
        from cosyvoice_fast.flow.kernels.dit_blas import BlasDiT

        return BlasDiT(est, n_steps)
    return est


def dit_forward_flops(cfg: DiTConfig, rows: int, frames: int, streaming: bool = False) -> float:
    """Floating-point operations (2 per multiply-add) of one forward over ``rows`` x ``frames``; chunk-causal
    attention counts only the visible keys."""
    n = rows * frames
    d, inner, ff = cfg.dim, cfg.inner_dim, cfg.dim * cfg.ff_mult
    gemm = 2 * n * (3 * d * inner + inner * d + 2 * d * ff)
    if streaming:
        c = cfg.static_chunk_size
        keys = sum(min(frames, (i // c + 1) * c) for i in range(frames))
    else:
        keys = frames * frames
    attn = 2 * 2 * rows * cfg.heads * keys * cfg.dim_head
    ada = 2 * rows * d * 6 * d
    per_block = gemm + attn + ada
    conv = 2 * 2 * n * d * (d // cfg.conv_pos_groups) * cfg.conv_pos_kernel
    edges = 2 * n * (cfg.in_features * d + d * cfg.mel_dim) + 2 * rows * (cfg.time_freq_dim * d + d * d + 2 * d * d)
    return float(cfg.depth * per_block + conv + edges)


def _inputs(cfg: DiTConfig, rows: int, frames: int, dtype: torch.dtype, device: torch.device) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return (r(rows, cfg.mel_dim, frames), torch.ones(rows, 1, frames, device=device, dtype=dtype),
            r(rows, cfg.mu_dim, frames), torch.rand(rows, generator=g).to(device, dtype), r(rows, cfg.spk_dim),
            r(rows, cfg.mel_dim, frames))


def _events_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _variant(est: torch.nn.Module, flow: torch.nn.Module, args: tuple, streaming: bool, iters: int,
             frames: int, flops: float, peak: float) -> dict:
    """Times of one estimator module (the eager DiT or its fused kernels): direct calls, raw graph replay, the
    graph runner's call and one step of a replayed solve."""
    from cosyvoice_fast.bench.estimator_profile import graph_profile
    from cosyvoice_fast.flow.graph import GraphEstimator

    chunk = flow.cfg.dit.static_chunk_size
    rows = args[0].shape[0]
    with torch.inference_mode():
        direct = _events_ms(lambda: est(*args, streaming), iters)
        raw = graph_profile(lambda: est(*args, streaming), iters=iters)
        runner = GraphEstimator(est, args[0].device, chunk, buckets=(frames,))
        graphed = _events_ms(lambda: runner(*args, streaming), iters)
        n_steps, w = flow.cfg.cfm.n_timesteps, flow.cfg.cfm.inference_cfg_rate
        solver = GraphEstimator(est, args[0].device, chunk, buckets=(frames,), solver=(w, n_steps))
        half = rows // 2
        mu, mask, spks, cond = args[2][:half], args[1][:half], args[4][:half], args[5][:half]
        solve = _events_ms(lambda: flow.decoder.solve_batch(mu, mask, spks, cond, n_steps, streaming,
                                                            estimator=solver), max(3, iters // n_steps))

    def rate(ms: float) -> float:
        return round(flops / (ms * 1e-3) / 1e12, 1)

    return {"direct_ms": round(direct, 4), "direct_tflops": rate(direct),
            "graph_ms": raw["ms"], "graph_tflops": rate(raw["ms"]),
            "graph_fraction_of_peak": round(rate(raw["ms"]) / peak, 4),
            "graph_kernels": raw["kernels"], "graph_kernel_us_total": raw["kernel_us_total"],
            "top_kernels_us": raw["by_kernel_us"], "runner_ms": round(graphed, 4),
            "solve_step_ms": round(solve / n_steps, 4)}


def profile(cfg: DiTConfig, rows: int, frames: int, dtype: torch.dtype, iters: int, streaming: bool,
            peak: float, variants: tuple[str, ...] = VARIANTS) -> dict:
    """One JSON-ready dict: the shape, its FLOPs, and per variant (:data:`VARIANTS`) the times of
    :func:`_variant` and, for the kernel variants, ``<variant>_vs_eager_maxabs`` (the same forward's largest
    difference from the PyTorch modules)."""
    from cosyvoice_fast.flow.model.dit_flow import DiTFlow

    dev = torch.device("cuda")
    torch.manual_seed(0)
    flow = DiTFlow(DiTFlowConfig(dit=cfg)).to(dev, dtype).eval()
    est = flow.decoder.estimator
    with torch.no_grad():
        for p in est.parameters():  # N(0, 1/fan_in) for matrices: realistic activations (defaults are tiny)
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
    args = _inputs(cfg, rows, frames, dtype, dev)
    flops = dit_forward_flops(cfg, rows, frames, streaming)
    res = {"device": torch.cuda.get_device_name(dev), "dtype": str(dtype).replace("torch.", ""),
           "dim": cfg.dim, "depth": cfg.depth, "heads": cfg.heads, "dim_head": cfg.dim_head, "ff_mult": cfg.ff_mult,
           "rows": rows, "frames": frames, "streaming": streaming, "gflop_per_forward": round(flops / 1e9, 2),
           "peak_tflops": peak}
    for name in variants:
        try:
            module = _module(name, est, flow.cfg.cfm.n_timesteps)
            if module is not est:
                with torch.inference_mode():
                    ref, got = est(*args, streaming), module(*args, streaming)
                res[f"{name}_vs_eager_maxabs"] = float((ref.float() - got.float()).abs().max())
            res[name] = _variant(module, flow, args, streaming, iters, frames, flops, peak)
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the other still measured
            res[name] = {"error": f"{type(e).__name__}: {e}"}
    return res


def main(argv: list[str] | None = None) -> int:
    d = DiTConfig()
    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.dit_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--depth", type=int, default=d.depth)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--dim-head", type=int, default=d.dim_head)
    ap.add_argument("--ff-mult", type=int, default=d.ff_mult)
    ap.add_argument("--rows", type=int, default=2, help="estimator rows (2 = one request's CFG pair)")
    ap.add_argument("--frames", type=int, default=112)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--streaming", action="store_true", help="chunk-causal attention (non-final chunks)")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list of eager (the PyTorch modules: the old cudagraph path), cudagraph (BlasDiT: "
                         "what the cudagraph and fused stages capture)")
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the benchmark times CUDA graphs)")
    if a.rows < 2 or a.rows % 2:
        ap.error("--rows must be even and >= 2 (conditional and unconditional rows of each request)")
    cfg = DiTConfig(dim=a.dim, depth=a.depth, heads=a.heads, dim_head=a.dim_head, ff_mult=a.ff_mult)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    variants = tuple(v for v in a.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants takes any of {', '.join(VARIANTS)}, got {a.variants!r}")
    res = profile(cfg, a.rows, a.frames, dtype, a.iters, a.streaming, a.peak_tflops, variants)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
