"""Decode-step measurements of the LLM backends' math on a GPU: kernels per step, GPU ms per step, achieved GB/s.

A decode step reads every decoder weight once plus each row's filled KV prefix, and does ~2 FLOPs per weight
per row, so at 1-16 rows its floor is memory bandwidth: ``bytes / peak``.  :func:`step_profile` runs the
decoder math exactly as each backend calls it inside its decode graph (``cudagraph``: the model's PyTorch
decoder over the KV bucket; ``fused``: :func:`..kernels.qwen2_decode.decode_step`), captures it in a CUDA graph
and reports replay time against that floor.  Kernel counts and per-kernel GPU time come from ``torch.profiler``
on an uncaptured call (a graph replays exactly the kernels its capture launched).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

H100_GBS = 3350.0  # H100 SXM HBM3 peak, GB/s


@dataclass(frozen=True)
class StepProfile:
    backend: str
    rows: int
    context: int  # KV positions each row attends over (its own filled prefix)
    kernels: int  # kernel launches per step
    kernel_ms: float  # summed kernel time per step (no launch gaps)
    graph_ms: float  # CUDA-graph replay time per step (what a token costs the GPU)
    mbytes: float  # weights + KV read per step
    gbs: float  # achieved: mbytes / graph_ms
    peak_fraction: float  # gbs / H100_GBS
    by_kernel: dict = field(default_factory=dict)  # kernel name -> (launches per step, us per step), top 8

    def as_dict(self) -> dict:
        return asdict(self)


def decoder_bytes(lm: torch.nn.Module, rows: int, context: int) -> int:
    """Bytes a decode step must read: the decoder's layer and final-norm weights once, plus K and V of
    ``context`` positions per row per layer (embedding tables and the speech head are outside the decoder)."""
    dec = lm.decoder
    weights = sum(p.numel() * p.element_size() for n, p in dec.named_parameters() if not n.startswith("embed"))
    cfg = dec.cfg
    kv = 2 * rows * cfg.num_hidden_layers * cfg.num_key_value_heads * context * cfg.head_dim
    return weights + kv * next(dec.parameters()).element_size()


def decode_math(lm: torch.nn.Module, backend: str, rows: int, context: int, max_len: int,
                kv_len: int | None = None) -> Callable[[], torch.Tensor]:
    """One decode step of ``rows`` rows (row b at position ``context - 1 - b``) over a random-filled cache, as
    ``backend`` computes it; ``kv_len`` is the attention bucket the graph runner would pass."""
    from cosyvoice_fast.llm.kernels.qwen2_decode import decode_step

    if context < rows or context > max_len:
        raise ValueError(f"context {context} must lie in rows={rows}..max_len={max_len}")
    param = next(lm.parameters())
    dev, dtype = param.device, param.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    cache = lm.new_cache(max_len, batch=rows)
    for t in cache.k + cache.v:
        t.normal_(generator=g)
    x = (torch.randn(rows, 1, lm.decoder.cfg.hidden_size, device=dev, generator=g) * 0.05).to(dtype)
    pos = (context - 1 - torch.arange(rows, device=dev)).view(rows, 1)
    kv_len = max_len if kv_len is None else kv_len
    if backend == "cudagraph":
        return lambda: lm.decoder(x, pos, cache, kv_len=kv_len)
    if backend == "fused":
        return lambda: decode_step(lm.decoder, x, pos, cache, kv_len=kv_len)
    raise ValueError(f"unknown backend {backend!r}; choose cudagraph or fused")


def step_over_cache(lm: torch.nn.Module, fused: bool, x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
                    kv_len: int) -> tuple[torch.Tensor, object]:
    """One decode step of embeddings ``x`` (rows, 1, H) at positions ``pos`` (rows, 1) over a fresh cache filled
    from ``kv`` (2, layers, rows, kv heads, max_len, head dim), by the fused kernels or the eager decoder;
    returns the hidden states and the cache (the step's K/V written into it).  The correctness checks of the
    fused step compare the two on the very same inputs."""
    from cosyvoice_fast.llm.kernels.qwen2_decode import decode_step

    cache = lm.new_cache(kv.shape[4], batch=x.shape[0])
    for i in range(len(cache.k)):
        cache.k[i].copy_(kv[0, i])
        cache.v[i].copy_(kv[1, i])
    with torch.inference_mode():
        h = decode_step(lm.decoder, x, pos, cache, kv_len) if fused else lm.decoder(x, pos, cache, kv_len=kv_len)
    return h, cache


def graph_ms(fn: Callable[[], object], iters: int = 100) -> float:
    """Milliseconds per replay of ``fn`` captured as a CUDA graph (warmed up first: Triton compiles there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        fn()
    ms = replay_ms(graph, iters)
    del graph
    return ms


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 100) -> float:
    """Milliseconds per replay of a captured graph: one replay first, then ``iters`` back to back between two
    events (the mean, so launch gaps between replays count as they do when the engine steps)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_profile(fn: Callable[[], object], steps: int = 3) -> tuple[int, float, dict]:
    """(kernels per call, summed kernel ms per call, {name: (launches, us) per call} of the 8 costliest) of
    ``fn`` run uncaptured under ``torch.profiler``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in kernels:
        row = table[e.name[:60]]
        row[0] += 1 / steps
        row[1] += e.time_range.elapsed_us() / steps
    top = dict(sorted(((k, (round(n, 1), round(us, 1))) for k, (n, us) in table.items()), key=lambda kv: -kv[1][1])[:8])
    return round(len(kernels) / steps), sum(e.time_range.elapsed_us() for e in kernels) / steps / 1e3, top


def step_profile(lm: torch.nn.Module, backend: str, rows: int, context: int, max_len: int,
                 kv_len: int | None = None, iters: int = 100) -> StepProfile:
    fn = decode_math(lm, backend, rows, context, max_len, kv_len)
    ms = graph_ms(fn, iters)
    kernels, kernel_ms, top = kernel_profile(fn)
    mb = decoder_bytes(lm, rows, context) / 1e6
    gbs = mb / ms  # MB per ms = GB/s
    return StepProfile(backend, rows, context, kernels, round(kernel_ms, 4), round(ms, 4), round(mb, 1),
                       round(gbs, 1), round(gbs / H100_GBS, 3), top)


def backend_ms_per_token(stage: object, inputs: object, text: torch.Tensor, rows: int, tokens: int) -> float:
    """Wall ms per decode round of a backend with ``rows`` requests stepping together (one ``prefill`` of them
    all, then batched ``decode`` calls; forced length, eos ignored): what a token costs a request including
    sampling and the per-step host sync."""
    new_state = stage.new_state  # type: ignore[attr-defined]
    states = [new_state(inputs, text, torch.Generator(device="cuda").manual_seed(i), tokens, True) for i in range(rows)]
    try:
        stage.prefill(states)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        t = time.perf_counter()
        n = 0
        while not all(st.done for st in states):
            stage.decode([st for st in states if not st.done])  # type: ignore[attr-defined]
            n += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / max(1, n)
    finally:
        for st in states:
            stage.release(st)  # type: ignore[attr-defined]
