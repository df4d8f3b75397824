"""One GPU run: the fused estimator on incremental windows against its full-recompute forward.

    PYTHONUNBUFFERED=1 python benchmarks/window_check.py --out $OUT/window_check.json

Full-size estimator (CosyVoice2 DecoderConfig), seeded random weights, bf16, the CFG pair (2 rows).  For each
case, one forward replayed as a CUDA graph (median ms), its kernel count, and its GPU time by kernel name:

* ``forward_F``: :meth:`FusedEstimator.forward` over F frames, chunk-causal (what a recomputed chunk runs);
* ``window_S_N_C``: :meth:`FusedEstimator.forward_window` on N new frames after S cached ones, with key
  buffers of capacity C (what the incremental runner replays: the benchmark's first chunk from an empty state
  is S=0, N=200; from the voice's cached prompt state S=100, N=100; its second chunk S=200, N=56 -> 100).

The difference between a window and the forward of the same frame count is the cost of the window itself (the
conv-context updates, the cached keys), which the by-kernel table shows.  A first step, ``attention``, times the
cached attention alone at each window shape for a few query/key tiles, next to the forward's attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import gpu_runner, step_args  # noqa: E402

CASES = {"forward": (100, 200), "window": ((0, 200, 250), (100, 100, 250), (200, 100, 500))}


def _setup():
    from cosyvoice_fast.config.model import DecoderConfig
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder
    from cosyvoice_fast.flow.model.incremental import RecordingWindow, estimator_increment

    torch.manual_seed(0)
    est = CausalConditionalDecoder(DecoderConfig()).to("cuda", torch.bfloat16).eval()
    c = est.cfg.out_channels
    z = torch.zeros(2, c, 1, device="cuda", dtype=torch.bfloat16)
    rec = RecordingWindow(est.cfg.static_chunk_size)
    with torch.inference_mode():
        estimator_increment(est, z, z, torch.zeros(2, device="cuda", dtype=torch.bfloat16),
                            torch.zeros(2, c, device="cuda", dtype=torch.bfloat16), z, rec)
    return est, FusedEstimator(est), rec.layout


def _window(layout, start: int, n: int, cap: int):
    from cosyvoice_fast.flow.model.incremental import StaticWindow, static_mask

    (h, d), = {(a, b) for kind, a, b in layout if kind == "kv"}
    n_attn = sum(1 for kind, *_ in layout if kind == "kv")
    g = torch.Generator(device="cpu").manual_seed(1)
    kv = torch.randn(n_attn, 2, 2, h, cap, d, generator=g).to("cuda", torch.bfloat16)
    ctx = [torch.randn(2, ch, left, generator=g).to("cuda", torch.bfloat16)
           for kind, ch, left in layout if kind == "conv"]
    dev = torch.device("cuda")
    return StaticWindow(kv, ctx, torch.arange(start, start + n, device=dev),
                        {2: torch.arange(n, n + 2, device=dev)}, static_mask(start, n, n, cap, 50, dev),
                        torch.full((1,), n, device=dev))


def step_forward(frames: int) -> dict:
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs, graph_profile

    est, fused, _ = _setup()
    args = estimator_inputs(est.cfg, 2, frames, torch.bfloat16)
    with torch.inference_mode():
        return graph_profile(lambda: fused(*args, True))


def step_window(start: int, n: int, cap: int) -> dict:
    from cosyvoice_fast.bench.estimator_profile import graph_profile

    est, fused, layout = _setup()
    win = _window(layout, start, n, cap)
    g = torch.Generator(device="cpu").manual_seed(2)
    x, mu, cond = (torch.randn(2, est.cfg.out_channels, n, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    spks = torch.randn(2, est.cfg.out_channels, generator=g).to("cuda", torch.bfloat16)
    t = torch.full((2,), 0.3, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        return graph_profile(lambda: fused.forward_window(x, mu, t, spks, cond, win))


ATTN_TILES = [(16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (32, 32, 4, 3), (16, 32, 2, 3), (64, 128, 4, 2),
              (32, 128, 4, 2), (16, 128, 4, 2), (64, 128, 8, 2)]


def step_attention() -> dict:
    """The cached attention alone (10 launches per graph, µs per launch) at each window shape and tile, and
    the full forward's attention at the same new-frame counts for reference."""
    from cosyvoice_fast.flow.kernels.estimator_attention import attention
    from cosyvoice_fast.bench.estimator_profile import graph_replay_ms
    from cosyvoice_fast.flow.kernels.estimator_window import attention_cached

    h, d, out = 8, 64, {}
    g = torch.Generator(device="cpu").manual_seed(4)
    with torch.inference_mode():
        for start, n, cap in CASES["window"]:
            qkv = torch.randn(2 * n, 3 * h * d, generator=g).to("cuda", torch.bfloat16)
            kv = torch.randn(2, 2, h, cap, d, generator=g).to("cuda", torch.bfloat16)
            s0, nv = torch.tensor([start], device="cuda"), torch.tensor([n], device="cuda")
            for bm, bn, w, st in ATTN_TILES:
                tiles = {"bm": bm, "bn": bn, "warps": w, "stages": st}
                fn = lambda: [attention_cached(qkv, kv, s0, nv, h, d, 50, tiles) for _ in range(10)]  # noqa: E731,B023
                try:
                    out[f"cached_{start}_{n}_{bm}x{bn}x{w}_us"] = round(graph_replay_ms(fn, iters=30) * 100, 2)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is a result
                    out[f"cached_{start}_{n}_{bm}x{bn}x{w}_us"] = f"{type(e).__name__}: {str(e)[:120]}"
            mask = torch.ones(2 * n, device="cuda", dtype=torch.bfloat16)
            fn = lambda: [attention(qkv, mask, 2, h, d, 50) for _ in range(10)]  # noqa: E731,B023
            out[f"full_{n}_us"] = round(graph_replay_ms(fn, iters=30) * 100, 2)
    return out


def main() -> int:
    out, only = step_args("attention,forward,window")
    runner = gpu_runner("window_check.py", out, step_timeout=120)
    if "attention" in only:
        runner.run("attention", step_attention)
    for f in CASES["forward"] if "forward" in only else ():
        runner.run(f"forward_{f}", lambda f=f: step_forward(f))
    for s, n, c in CASES["window"] if "window" in only else ():
        runner.run(f"window_{s}_{n}_{c}", lambda s=s, n=n, c=c: step_window(s, n, c))
    for name, r in runner.results.items():
        if isinstance(r, dict) and "ms" in r:
            print(f"{name:22s} {r['ms']:.3f} ms  {r['kernels']} kernels  {r['kernel_us_total']} us of kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
