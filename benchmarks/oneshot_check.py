"""One GPU run for the one-shot estimator GEMMs (``kernels/estimator_oneshot.py``) against the row-tiled ones.

    PYTHONUNBUFFERED=1 python benchmarks/oneshot_check.py --out $OUT/oneshot_check.json

Full-size estimator shapes (C = 256, 8 heads x 64, feed-forward 1024), bf16, seeded random weights:
1. ``errors``: each transformer GEMM kind (q/k/v with LayerNorm, out-projection + residual, FF1 with LayerNorm
   and GELU, FF2 + residual) against torch in fp32, one-shot and row-tiled, fp32 and bf16, at 412 rows.
2. ``chain``: per GEMM kind, 56 launches with a distinct weight each (the estimator's 56 blocks; one kind's
   weights alone fit in L2, a forward's ~100 MB do not) captured in one graph: µs per launch, row-tiled vs
   one-shot tile variants.
3. ``stack``: 56 whole transformer blocks (q/k/v, attention, out, FF1, FF2) with the row-tiled GEMMs vs the
   one-shot ones (attention unchanged, and with 16-row query tiles): ms per stack at 112 and 412 rows.
4. ``estimator``: the full fused estimator forward (2 x 56 and 2 x 206 frames) as shipped, for the same call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_attention import attention  # noqa: E402
from cosyvoice_fast.kernels.common import LAUNCH  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_linear import ACT_GELU, PRO_LN, PRO_NONE, linear  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import graph_replay_ms  # noqa: E402

C, HEADS, D, FF, BLOCKS = 256, 8, 64, 1024, 56
KINDS = {  # name: (N, K, layernorm prologue, act, residual)
    "qkv": (3 * HEADS * D, C, True, 0, False),
    "out": (C, HEADS * D, False, 0, True),
    "ff1": (FF, C, True, ACT_GELU, False),
    "ff2": (C, FF, False, 0, True),
}
VARIANTS = {  # (bm, bn, warps[, bk, stages]) per GEMM kind
    "qkv": [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (32, 64, 4), (64, 32, 4)],
    "out": [(32, 32, 4), (16, 16, 4), (64, 32, 4), (64, 16, 4), (32, 16, 4), (64, 64, 4)],
    "ff1": [(32, 64, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (32, 128, 4)],
    "ff2": [(16, 32, 4, 1024, 1), (32, 16, 4, 1024, 1), (32, 32, 4, 256, 2), (64, 32, 4, 256, 2),
            (64, 16, 4, 256, 2), (32, 16, 4, 256, 2), (64, 32, 4, 512, 2), (16, 16, 4, 256, 2)],
}


def _tiles(v: tuple) -> dict:
    t = {"bm": v[0], "bn": v[1], "warps": v[2]}
    if len(v) > 3:
        t.update(bk=v[3], stages=v[4])
    return t


def _name(v: tuple) -> str:
    return "oneshot_" + "x".join(str(i) for i in v)


def _weights(dtype: torch.dtype, seed: int = 0) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)

    return [{"qkv": rnd(3 * HEADS * D, C, scale=C ** -0.5), "out": rnd(C, HEADS * D, scale=C ** -0.5),
             "out_b": rnd(C, scale=0.02), "ff1": rnd(FF, C, scale=C ** -0.5), "ff1_b": rnd(FF, scale=0.02),
             "ff2": rnd(C, FF, scale=FF ** -0.5), "ff2_b": rnd(C, scale=0.02),
             "ln1": (1 + rnd(C, scale=0.1), rnd(C, scale=0.1), 1e-5),
             "ln3": (1 + rnd(C, scale=0.1), rnd(C, scale=0.1), 1e-5)} for _ in range(BLOCKS)]


def _call(kind: str, w: dict, x: torch.Tensor, res: torch.Tensor | None, oneshot: bool, tiles=None):
    n, k, ln, act, has_res = KINDS[kind]
    bias = w.get(f"{kind}_b")
    lnp = w["ln1"] if kind == "qkv" else w["ln3"] if kind == "ff1" else None
    if oneshot:
        return linear_oneshot(x, w[kind], bias, prologue=PRO_LN if ln else PRO_NONE, ln=lnp, act=act,
                              residual=res if has_res else None, tiles=tiles)
    saved = LAUNCH["oneshot"]
    LAUNCH["oneshot"] = False  # the row-tiled kernel, whatever linear() routes by default
    try:
        return linear(x, w[kind], bias, prologue=PRO_LN if ln else 0, ln=lnp, act=act,
                      residual=res if has_res else None)
    finally:
        LAUNCH["oneshot"] = saved


def _reference(kind: str, w: dict, x: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
    n, k, ln, act, has_res = KINDS[kind]
    a = x.float()
    if ln:
        g, b, eps = w["ln1"] if kind == "qkv" else w["ln3"]
        a = F.layer_norm(a, (k,), g.float(), b.float(), eps)
    y = a @ w[kind].float().T
    if f"{kind}_b" in w:
        y = y + w[f"{kind}_b"].float()
    if act == ACT_GELU:
        y = F.gelu(y)
    if has_res:
        y = y + res.float()
    return y


def step_errors(rows: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = _weights(dtype)[0]
        g = torch.Generator(device="cpu").manual_seed(1)
        for kind, (n, k, *_rest) in KINDS.items():
            x = torch.randn(rows, k, generator=g).to("cuda", dtype)
            res = torch.randn(rows, n, generator=g).to("cuda", dtype)
            ref = _reference(kind, w, x, res)
            for name, oneshot in (("rowtiled", False), ("oneshot", True)):
                y = _call(kind, w, x, res, oneshot)
                out[f"{str(dtype)[6:]}_{kind}_{name}"] = (y.float() - ref).abs().max().item()
    return out


def step_chain(rows: int) -> dict:
    ws = _weights(torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(2)
    out = {}
    for kind, (n, k, *_rest) in KINDS.items():
        x = torch.randn(rows, k, generator=g).to("cuda", torch.bfloat16)
        res = torch.randn(rows, n, generator=g).to("cuda", torch.bfloat16)
        variants = [("rowtiled", False, None)] + [(_name(v), True, _tiles(v)) for v in VARIANTS[kind]]
        for name, oneshot, tiles in variants:
            def run() -> None:
                for i in range(BLOCKS):
                    _call(kind, ws[i], x, res, oneshot, tiles)  # noqa: B023 - called at once

            try:
                out[f"{kind}_{name}_us"] = round(1000 * graph_replay_ms(run, iters=30) / BLOCKS, 3)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is recorded, not fatal
                out[f"{kind}_{name}_us"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _block(w: dict, h: torch.Tensor, mask: torch.Tensor, batch: int, oneshot: bool, attn_tiles,
           best: dict) -> torch.Tensor:
    qkv = _call("qkv", w, h, None, oneshot, best.get("qkv"))
    o = attention(qkv, mask, batch, HEADS, D, 50, tiles=attn_tiles)
    h = _call("out", w, o, h, oneshot, best.get("out"))
    hid = _call("ff1", w, h, None, oneshot, best.get("ff1"))
    return _call("ff2", w, hid, h, oneshot, best.get("ff2"))


def best_tiles(chain: dict | None) -> dict:
    """The fastest one-shot variant per GEMM kind in a ``chain`` step's result (empty when it did not run)."""
    best = {}
    for kind in KINDS:
        timed = [(chain[f"{kind}_{_name(v)}_us"], v) for v in VARIANTS[kind]
                 if isinstance((chain or {}).get(f"{kind}_{_name(v)}_us"), float)]
        if timed:
            best[kind] = _tiles(min(timed)[1])
    return best


def step_stack(frames: int, best: dict) -> dict:
    ws = _weights(torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(3)
    rows = 2 * frames
    h0 = torch.randn(rows, C, generator=g).to("cuda", torch.bfloat16)
    mask = torch.ones(rows, device="cuda", dtype=torch.bfloat16)
    out = {}
    results = {}
    out["best_tiles"] = best
    for name, oneshot, attn_tiles, tiles in (
            ("rowtiled", False, None, {}), ("oneshot", True, None, {}), ("oneshot_best", True, None, best),
            ("oneshot_best_attn16", True, {"bm": 16, "bn": 64, "warps": 4, "stages": 2}, best),
            ("oneshot_best_attn32", True, {"bm": 32, "bn": 64, "warps": 4, "stages": 2}, best)):
        def run() -> torch.Tensor:
            h = h0
            for w in ws:
                h = _block(w, h, mask, 2, oneshot, attn_tiles, tiles)  # noqa: B023 - called at once
            return h

        results[name] = run().float()
        out[f"{name}_ms"] = round(graph_replay_ms(run, iters=30), 4)
    out["oneshot_vs_rowtiled_maxdiff"] = (results["oneshot"] - results["rowtiled"]).abs().max().item()
    out["ref_absmax"] = results["rowtiled"].abs().max().item()
    return out


def step_estimator() -> dict:
    from cosyvoice_fast.config.model import DecoderConfig
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs
    from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder

    torch.manual_seed(0)
    est = CausalConditionalDecoder(DecoderConfig()).to("cuda", torch.bfloat16).eval()
    fused = FusedEstimator(est)
    out = {}
    with torch.inference_mode():
        for frames in (56, 206):
            args = estimator_inputs(est.cfg, 2, frames, torch.bfloat16)
            fused(*args, True)
            out[f"fused_2x{frames}_ms"] = round(graph_replay_ms(lambda: fused(*args, True), iters=30), 4)  # noqa: B023
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="", help="comma-separated: errors, chain, stack, estimator (all if empty)")
    args = ap.parse_args()
    only = {s for s in args.steps.split(",") if s}
    require_cuda("oneshot_check.py")
    torch.backends.cuda.matmul.allow_tf32 = False
    runner = StepRunner(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__},
                        step_timeout=150)
    best = lambda rows: best_tiles(runner.results.get(f"chain_{rows}"))  # noqa: E731 - the stacks' tiles
    steps = [("errors", lambda: step_errors(412)), ("chain_412", lambda: step_chain(412)),
             ("chain_112", lambda: step_chain(112)), ("stack_206", lambda: step_stack(206, best(412))),
             ("stack_56", lambda: step_stack(56, best(112))), ("estimator", step_estimator)]
    for name, fn in steps:
        if not only or name.split("_")[0] in only:
            runner.run(name, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
