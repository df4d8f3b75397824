"""Kernel counts and graph-replay times of one estimator forward, eager-graph (``cudagraph``) vs ``fused``.

:func:`estimator_profile` gives ``profile_stages`` one line per
(backend, shape) with kernels, GPU ms and the achieved TFLOP/s against the H100's dense bf16 peak.  Counts
come from ``torch.profiler`` over one forward launched normally (the same kernels a CUDA graph of it replays);
memcpy/memset activity is not a kernel and is left out.  Times are graph replays (:func:`~cosyvoice_fast.bench.
profile_llm.graph_ms`, the one graph timer of the benchmarks), the way the flow backends run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from cosyvoice_fast.bench.profile_llm import graph_ms


def count_kernels(fn: Callable[[], object]) -> int:
    """GPU kernels launched by one call of ``fn`` (call it once before, so compilation is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if "memcpy" not in n.lower() and "memset" not in n.lower())


def kernel_times(fn: Callable[[], object]) -> list[tuple[str, float]]:
    """(name, GPU µs) of every kernel one call of ``fn`` launches, in launch order (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.end - e.time_range.start) for e in evs]


def graph_profile(fn: Callable[[], object], iters: int = 30, top: int = 12) -> dict:
    """``fn`` as a CUDA graph: median replay ms, its kernel count, their GPU µs summed, and the ``top`` kernel
    names by summed µs (a replay's time against its kernels' time shows how much the launches overlap)."""
    fn()
    times = kernel_times(fn)
    by_name: dict[str, float] = defaultdict(float)
    for name, us in times:
        by_name[name.split("(")[0][:60]] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"ms": round(graph_ms(fn, iters=iters), 4), "kernels": len(times),
            "kernel_us_total": round(sum(us for _, us in times), 1),
            "by_kernel_us": {k: round(v, 1) for k, v in ranked}}


def estimator_inputs(cfg, rows: int, frames: int, dtype: torch.dtype, device: str = "cuda",  # noqa: ANN001
                     valid: Sequence[int] | None = None, seed: int = 0) -> tuple[Tensor, ...]:
    """Random estimator inputs ``(x, mask, mu, t, spks, cond)``; ``valid[r]`` frames of row r are real (the
    rest zero with mask 0), all frames by default."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = cfg.out_channels

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    mask = torch.ones(rows, 1, frames)
    for r, n in enumerate(valid or ()):
        mask[r, :, n:] = 0
    mask = mask.to(device=device, dtype=dtype)
    x, mu, cond = rnd(rows, c, frames) * mask, rnd(rows, c, frames) * mask, rnd(rows, c, frames) * mask
    t = torch.rand(rows, generator=g).to(device=device, dtype=dtype)
    return x, mask, mu, t, rnd(rows, c), cond


def estimator_kernels(estimator: torch.nn.Module, fused: torch.nn.Module, frames: int, rows: int = 2,
                      streaming: bool = True) -> dict[str, int]:
    """Kernels per estimator forward for ``cudagraph`` (the eager estimator's kernels) and ``fused``."""
    dtype = next(estimator.parameters()).dtype
    args = estimator_inputs(estimator.cfg, rows, frames, dtype)
    out = {}
    with torch.inference_mode():
        for name, mod in (("cudagraph", estimator), ("fused", fused)):
            mod(*args, streaming)
            out[name] = count_kernels(lambda: mod(*args, streaming))  # noqa: B023 - called at once
    return out


def kernels_per_forward(n_blocks: int, num_mid_blocks: int, resnet_split_ln: bool = False) -> int:
    """Launches of one fused forward of the one-level U-Net below ``FlowTuning.many_rows_m`` rows (above it
    an epilogue pass joins each GEMM left on cuBLAS, and a LayerNorm pass each group's first transformer block): 3
    time-embedding GEMMs (3 fewer when the forward is given its row of a ``FusedEstimator.time_table``), the
    input pack, 2 per ResNet block (4 when its convs are split from their LayerNorm passes), 5 per transformer
    block, the down/up/final convs and the output projection."""
    resnets = 2 + num_mid_blocks
    per_resnet = 4 if resnet_split_ln else 2
    return 3 + 1 + per_resnet * resnets + 5 * n_blocks * resnets + 4


H100_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H100 SXM


def estimator_flops(cfg, rows: int, frames: int, streaming: bool) -> float:  # noqa: ANN001 - DecoderConfig
    """Useful FLOPs of one forward of the one-level estimator: every GEMM/conv as 2·M·N·K plus attention
    (QK and PV) over the keys each query may see (chunk-causal: up to the end of its chunk)."""
    m = rows * frames
    c, inner = cfg.channels[0], cfg.num_heads * cfg.attention_head_dim
    chunk = cfg.static_chunk_size if streaming else 0
    keys = sum(min(frames, (i // chunk + 1) * chunk) if chunk else frames for i in range(frames))
    attn = 2 * 2 * rows * cfg.num_heads * cfg.attention_head_dim * keys
    block = 2 * m * (c * 3 * inner + inner * c + 2 * c * 4 * c) + attn

    def resnet(c_in: int) -> float:
        return 2 * m * (3 * c_in * c + c_in * c + 3 * c * c)

    resnets = resnet(cfg.in_channels) + cfg.num_mid_blocks * resnet(c) + resnet(2 * c)
    blocks = cfg.n_blocks * (2 + cfg.num_mid_blocks) * block
    convs = 3 * 2 * m * 3 * c * c + 2 * m * c * cfg.out_channels  # down, up, final block; final projection
    return float(resnets + blocks + convs)


@dataclass(frozen=True)
class EstimatorProfile:
    """One estimator forward of one backend at one shape, measured as ``profile_stages`` reports it."""

    backend: str
    rows: int
    frames: int
    kernels: int
    graph_ms: float  # median CUDA-graph replay: what a forward costs the GPU
    kernel_ms: float  # its kernels' GPU time summed (one uncaptured forward); above graph_ms when launches overlap
    gflop: float
    by_kernel_us: dict = field(default_factory=dict)  # kernel name -> summed GPU µs of one forward, costliest 8

    @property
    def tflops(self) -> float:
        return self.gflop / self.graph_ms

    def line(self) -> str:
        return (f"{self.backend:9s} {self.rows} rows x {self.frames:4d} frames: {self.kernels:4d} kernels, "
                f"{self.graph_ms:.3f} ms/forward (kernels summed {self.kernel_ms:.3f}), {self.gflop:.1f} GFLOP = "
                f"{self.tflops:.1f} TFLOP/s ({100 * self.tflops / H100_BF16_TFLOPS:.1f}% of "
                f"{H100_BF16_TFLOPS:.0f})")

    def as_dict(self) -> dict:
        return {**asdict(self), "tflops": round(self.tflops, 2)}


def _measure(backend: str, fn: Callable[[], object], rows: int, frames: int, gflop: float,
             iters: int) -> EstimatorProfile:
    g = graph_profile(fn, iters=iters, top=8)
    return EstimatorProfile(backend, rows, frames, g["kernels"], g["ms"], round(g["kernel_us_total"] / 1e3, 4),
                            round(gflop, 2), g["by_kernel_us"])


def estimator_profile(estimator: torch.nn.Module, frames: Sequence[int] = (56, 206), rows: int = 2,
                      streaming: bool = True, iters: int = 20, time_row: bool = True) -> list[EstimatorProfile]:
    """``cudagraph`` (the eager estimator captured) and ``fused`` side by side at each frame count.

    ``time_row``: the fused forward reads its step's row of :meth:`FusedEstimator.time_table`, as the flow
    backends' step graphs run it (three launches fewer); the eager estimator has no such table."""
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator

    if not torch.cuda.is_available():
        raise RuntimeError("estimator_profile needs a CUDA GPU")
    fused = FusedEstimator(estimator)
    dtype = next(estimator.parameters()).dtype
    out = []
    with torch.inference_mode():
        for n in frames:
            args = estimator_inputs(estimator.cfg, rows, n, dtype)
            tall = fused.time_table(args[3][:1], rows)[0] if time_row else None
            gflop = estimator_flops(estimator.cfg, rows, n, streaming) / 1e9
            out.append(_measure("cudagraph", lambda: estimator(*args, streaming), rows, n, gflop, iters))  # noqa: B023
            out.append(_measure("fused", lambda: fused(*args, streaming, tall=tall), rows, n, gflop,  # noqa: B023
                                iters))
    return out
