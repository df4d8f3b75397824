"""Is a grid barrier inside one persistent kernel cheaper than a kernel boundary in a CUDA graph?

    PYTHONUNBUFFERED=1 python benchmarks/persistent_probe.py --out $OUT/persistent_probe.json

The fused estimator is a chain of ~340 small dependent kernels (BENCHMARKS.md: ~6 µs each at 2 x 206 rows,
while each does well under a microsecond of arithmetic).  A persistent kernel (one program per SM) that runs the
same phases separated by grid-wide barriers replaces each kernel boundary by a barrier.  This script measures
both on the same work, so the design choice rests on a number:

* ``chain``: P phases of ``y = x @ W_p^T + b_p + x`` (M x 256 x 256, bf16, the estimator's channel width, a
  distinct weight per phase), one Triton launch per phase (with programmatic dependent launch, and without),
  captured in one CUDA graph: µs per phase;
* ``persistent``: the same P phases in one launch of ``#SMs`` programs with a grid barrier after each phase
  (atomic arrive, acquire-polling), with and without prefetching the next phase's weight tile before the
  barrier: µs per phase, and the result checked against the chain's;
* ``barrier``: the persistent kernel with no work: the barrier alone.

``--only-oneshot`` instead times the same chain through ``linear_oneshot`` (ping-pong, or every launch on one
input with a fresh output) beside the probe's own kernel, 56 phases: the two harnesses and kernels agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import graph_replay_ms  # noqa: E402
from cosyvoice_fast.kernels.pdl import pdl_options, pdl_start  # noqa: E402


@triton.jit
def _phase_tile(src, dst, b_ptr, w, tile, M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                CG: tl.constexpr):
    """One (BM, BN) tile of ``dst = src @ W^T + b + src`` (K = N), with the weight tile ``w`` already loaded."""
    n_n = N // BN
    tm = tile // n_n
    tn = tile - tm * n_n
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    rk = tl.arange(0, N)
    m_ok = rm < M
    if CG:
        a = tl.load(src + rm[:, None] * N + rk[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        r = tl.load(src + rm[:, None] * N + rn[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
    else:
        a = tl.load(src + rm[:, None] * N + rk[None, :], mask=m_ok[:, None], other=0.0)
        r = tl.load(src + rm[:, None] * N + rn[None, :], mask=m_ok[:, None], other=0.0)
    acc = tl.dot(a, w) + tl.load(b_ptr + rn).to(tl.float32)[None, :] + r.to(tl.float32)
    tl.store(dst + rm[:, None] * N + rn[None, :], acc.to(dst.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _w_tile(w_ptr, tile, N: tl.constexpr, BN: tl.constexpr):
    tn = tile % (N // BN)
    rn = tn * BN + tl.arange(0, BN)
    rk = tl.arange(0, N)
    return tl.load(w_ptr + rn[None, :] * N + rk[:, None])


@triton.jit
def _chain_kernel(src, dst, w_ptr, b_ptr, M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  PDL: tl.constexpr):
    tile = tl.program_id(0)
    w = _w_tile(w_ptr, tile, N, BN)
    pdl_start(PDL)
    _phase_tile(src, dst, b_ptr, w, tile, M, N, BM, BN, False)


@triton.jit
def _grid_sync(sync_ptr, target):
    """Wait until ``target`` arrivals are counted at ``sync_ptr`` (this program's own included)."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(buf, w_ptr, b_ptr, sync_ptr, M, PHASES, NPROG, N: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, WORK: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    tiles = tl.cdiv(M, BM) * (N // BN)
    w = _w_tile(w_ptr, pid % (N // BN), N, BN)
    for ph in range(PHASES):
        src = buf + (ph % 2) * M * N
        dst = buf + ((ph + 1) % 2) * M * N
        if WORK:
            for tile in range(pid, tiles, NPROG):
                if PREFETCH:
                    if tile != pid:
                        w = _w_tile(w_ptr + ph * N * N, tile, N, BN)
                else:
                    w = _w_tile(w_ptr + ph * N * N, tile, N, BN)
                _phase_tile(src, dst, b_ptr + ph * N, w, tile, M, N, BM, BN, True)
            if PREFETCH and ph + 1 < PHASES:
                w = _w_tile(w_ptr + (ph + 1) * N * N, pid, N, BN)
        _grid_sync(sync_ptr, (ph + 1) * NPROG)


def _setup(m: int, phases: int, n: int = 256) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(m, n, generator=g) * 0.5).to("cuda", torch.bfloat16)
    w = (torch.randn(phases, n, n, generator=g) / (4 * n ** 0.5)).to("cuda", torch.bfloat16)
    b = (torch.randn(phases, n, generator=g) * 0.01).to("cuda", torch.bfloat16)
    return x, w, b


def chain(m: int, phases: int, bm: int, bn: int, pdl: bool) -> dict:
    x, w, b = _setup(m, phases)
    n = x.shape[1]
    bufs = [x.clone(), torch.empty_like(x)]
    grid = (triton.cdiv(m, bm) * (n // bn),)

    def run() -> None:
        bufs[0].copy_(x)
        for p in range(phases):
            _chain_kernel[grid](bufs[p % 2], bufs[(p + 1) % 2], w[p], b[p], m, N=n, BM=bm, BN=bn, num_warps=4,
                                **pdl_options(pdl, x))

    run()
    out = bufs[phases % 2].clone()
    ms = graph_replay_ms(run, iters=50)
    return {"ms": round(ms, 4), "us_per_phase": round(1000 * ms / phases, 3), "programs": grid[0], "out": out}


def chain_oneshot(m: int, phases: int, bm: int, bn: int, same_x: bool) -> dict:
    """The probe's chain through ``linear_oneshot`` (ping-pong like ``chain``, or every launch on the same input
    with a fresh output, like ``oneshot_check.py``'s chain step)."""
    from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot

    x, w, b = _setup(m, phases)
    tiles = {"bm": bm, "bn": bn, "warps": 4}

    def run() -> torch.Tensor:
        h = x
        for p in range(phases):
            h = linear_oneshot(x if same_x else h, w[p], b[p], residual=x if same_x else h, tiles=tiles)
        return h

    out = run()
    ms = graph_replay_ms(run, iters=50)
    return {"ms": round(ms, 4), "us_per_phase": round(1000 * ms / phases, 3), "out": out}


def chain_same_x(m: int, phases: int, bm: int, bn: int) -> dict:
    """The probe's own kernel, every launch on the same input with a fresh output."""
    x, w, b = _setup(m, phases)
    n = x.shape[1]
    grid = (triton.cdiv(m, bm) * (n // bn),)

    def run() -> None:
        for p in range(phases):
            y = torch.empty_like(x)
            _chain_kernel[grid](x, y, w[p], b[p], m, N=n, BM=bm, BN=bn, num_warps=4, **pdl_options(True, x))

    ms = graph_replay_ms(run, iters=50)
    return {"ms": round(ms, 4), "us_per_phase": round(1000 * ms / phases, 3)}


def persistent(m: int, phases: int, bm: int, bn: int, work: bool, prefetch: bool) -> dict:
    x, w, b = _setup(m, phases)
    n = x.shape[1]
    nprog = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.empty(2, m, n, device="cuda", dtype=torch.bfloat16)
    sync = torch.zeros(1, device="cuda", dtype=torch.int32)

    def run() -> None:
        buf[0].copy_(x)
        sync.zero_()
        _persistent_kernel[(nprog,)](buf, w, b, sync, m, phases, nprog, N=n, BM=bm, BN=bn, WORK=work,
                                     PREFETCH=prefetch, num_warps=4)

    run()
    torch.cuda.synchronize()
    out = buf[phases % 2].clone()
    ms = graph_replay_ms(run, iters=50)
    return {"ms": round(ms, 4), "us_per_phase": round(1000 * ms / phases, 3), "programs": nprog, "out": out}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", type=int, default=224)
    ap.add_argument("--rows", default="112,412")
    ap.add_argument("--only-oneshot", action="store_true", help="only the chain vs linear_oneshot comparison")
    args = ap.parse_args()
    require_cuda("persistent_probe.py")
    runner = StepRunner(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                   "triton": triton.__version__}, step_timeout=120)
    if args.only_oneshot:
        for m in (int(r) for r in args.rows.split(",")):
            for bm, bn in ((16, 32), (32, 32)):
                key = f"m{m}_bm{bm}_bn{bn}"
                runner.run(f"chain_pdl_{key}", lambda: {k: v for k, v in chain(m, 56, bm, bn, True).items()
                                                        if k != "out"})
                runner.run(f"chain_same_x_{key}", lambda: chain_same_x(m, 56, bm, bn))
                for same in (False, True):
                    runner.run(f"oneshot_{'same_x' if same else 'pingpong'}_{key}",
                               lambda: {k: v for k, v in chain_oneshot(m, 56, bm, bn, same).items() if k != "out"})
        return 0
    for m in (int(r) for r in args.rows.split(",")):
        for bm, bn in ((16, 32), (32, 64)):
            key = f"m{m}_bm{bm}_bn{bn}"
            ref = {}

            def strip(d: dict) -> dict:
                """Drop the output tensor, keeping its largest difference from the first (chain) result."""
                out = d.pop("out")
                if "chain" not in ref:
                    ref["chain"] = out
                d["max_diff_vs_chain"] = (out.float() - ref["chain"].float()).abs().max().item()
                return d

            runner.run(f"chain_pdl_{key}", lambda: strip(chain(m, args.phases, bm, bn, True)))
            runner.run(f"chain_nopdl_{key}", lambda: strip(chain(m, args.phases, bm, bn, False)))
            runner.run(f"persistent_{key}", lambda: strip(persistent(m, args.phases, bm, bn, True, False)),
                       timeout=60)
            runner.run(f"persistent_prefetch_{key}",
                       lambda: strip(persistent(m, args.phases, bm, bn, True, True)), timeout=60)
    runner.run("barrier_only", lambda: {k: v for k, v in persistent(412, args.phases, 16, 32, False, False).items()
                                        if k != "out"}, timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
