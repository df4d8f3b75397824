"""One GPU run for the fused flow estimator: correctness at full size, kernel counts, graph-replay times.

    PYTHONUNBUFFERED=1 python benchmarks/fused_flow_check.py --out $OUT/fused_flow_check.json

Full-size estimator (CosyVoice2 DecoderConfig) with seeded random weights (timing does not depend on values).
1. fp32 and bf16 estimator outputs vs eager fp32 (TF32 off), CFG pair at 56 / 206 frames, chunk and full
   attention; a padded batch (rows of different lengths, one all-padding row) vs each row alone.
2. mel of a whole guided 10-step solve (206 frames) vs eager fp32: max, p99.9, mean |error|.
3. kernels per forward (torch.profiler), cudagraph (eager estimator) vs fused.
4. one forward as a CUDA graph replay (median of CUDA events) at 56 and 206 frames, bf16, for every fused
   configuration (FFN in one or two kernels, out-projection inside the attention kernel or not) and tile variant.
5. the launch settings (``estimator_common.LAUNCH``: programmatic dependent launch, early weight tiles, the
   one-shot GEMMs) on and off for each kernel configuration, same replays (``--launches`` picks some).
6. ``temb``: the time embedding's three GEMMs alone (a chain that does not depend on the frames), graph-replayed
   at 2 and 32 rows, the default routing against the row-tiled kernel everywhere.
7. ``oneshot_rows``: one CFG pair's forward at the engine's bucket lengths up to 250 frames, row-tiled against
   one-shot GEMMs (where ``LAUNCH["oneshot_max_rows"]`` belongs).
Every step runs under a time limit; the JSON is rewritten after each step (:mod:`benchmarks.steps`), and a
table is printed last.  ``--steps launch,kernels`` runs only the named steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.config.model import CFMConfig, DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator, kernels_per_forward  # noqa: E402
from cosyvoice_fast.kernels import common as estimator_common
from cosyvoice_fast.flow.kernels import estimator_conv, estimator_linear  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import count_kernels, estimator_inputs, graph_replay_ms, kernel_times

# Named tile settings timed in the variants step (a handful, not a sweep): (linear TUNING, conv TUNING)
# overrides of the defaults (4 warps, BK 128, tiles narrowed to >= 132 programs; BENCHMARKS.md, session 9).
VARIANTS = {
    "default": ({}, {}),
    "base": ({"bk": 64, "min_programs": 0}, {"bk": 64, "min_programs": 0}),  # run 2's tiles
    "no_spread": ({"min_programs": 0}, {"min_programs": 0}),
    "warps8_no_spread": ({"warps": 8, "min_programs": 0}, {"warps": 8, "min_programs": 0}),  # sessions 3-8
    "bk64": ({"bk": 64}, {"bk": 64}),
    "spread100": ({"min_programs": 100}, {"min_programs": 100}),
    "conv_ln_bm32": ({}, {"ln_bm": 32}),
    "bk256": ({"bk": 256}, {"bk": 256}),  # K <= 256 GEMMs (q/k/v, FF1) in one K step: fewer serial loads
}
# Launch settings timed in the ``launch`` step (``estimator_common.LAUNCH`` overrides).
LAUNCHES = {
    "no_pdl": {"pdl": False, "early_weights": False, "oneshot": False},
    "pdl_all_rows": {"pdl": True, "early_weights": False, "pdl_max_rows": 1 << 30, "oneshot": False},
    "pdl_early_weights_all_rows": {"pdl": True, "early_weights": True, "pdl_max_rows": 1 << 30, "oneshot": False},
    "rowtiled": {**estimator_common.LAUNCH, "oneshot": False},  # the default before the one-shot GEMMs
    "default": dict(estimator_common.LAUNCH),
}
from cosyvoice_fast.flow.model.cfm import CausalCFM  # noqa: E402


def err_stats(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a.float() - ref.float()).abs().flatten()
    k = max(1, int(round(0.999 * d.numel())))
    return {"max": d.max().item(), "p99.9": d.kthvalue(k).values.item(), "mean": d.mean().item(),
            "ref_absmax": ref.abs().max().item(), "finite": bool(torch.isfinite(a).all())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-timeout", type=int, default=150,
                    help="seconds per step (step 1 compiles every fp32 and bf16 kernel: 60 s was too short)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--steps", default="",
                    help="comma-separated step names to run (errors, padding, solve, kernels, timing, timeline, "
                         "variants, launch, temb, oneshot_rows); all when empty")
    ap.add_argument("--launches", default="", help="comma-separated LAUNCHES names for the launch step (all if empty)")
    args = ap.parse_args()
    only = {x for x in args.steps.split(",") if x}
    require_cuda("fused_flow_check.py")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    runner = StepRunner(args.out, res, step_timeout=args.step_timeout)

    torch.manual_seed(0)
    cfm32 = CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval()
    est32 = cfm32.estimator
    cfm16 = CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval()
    cfm16.load_state_dict(cfm32.state_dict())
    cfm16 = cfm16.to(torch.bfloat16)
    est16 = cfm16.estimator
    fused32, fused16 = FusedEstimator(est32), FusedEstimator(est16)
    fused16_one = FusedEstimator(est16, ffn_one_kernel=True)
    fused16_ao = FusedEstimator(est16, attention_out_fused=True)
    fused16_ao_one = FusedEstimator(est16, ffn_one_kernel=True, attention_out_fused=True)
    fused16_ao_ln = FusedEstimator(est16, attention_out_fused=True, resnet_split_ln=True)
    # (name, module) of every fused configuration counted and timed
    fused16_ln = FusedEstimator(est16, resnet_split_ln=False)
    fused_modes = (("fused", fused16), ("fused_one_kernel_ffn", fused16_one), ("fused_attn_out", fused16_ao),
                   ("fused_attn_out_one_kernel_ffn", fused16_ao_one), ("fused_attn_out_split_ln", fused16_ao_ln),
                   ("fused_whole_row_ln", fused16_ln))
    cfg = est32.cfg

    def estimator_errors() -> dict:
        r = {}
        with torch.inference_mode():
            for frames in (56, 206):
                for streaming in (True, False):
                    a32 = estimator_inputs(cfg, 2, frames, torch.float32, seed=frames)
                    a16 = tuple(z.to(torch.bfloat16) for z in a32)
                    ref = est32(*a32, streaming)
                    key = f"{frames}_{'chunk' if streaming else 'full'}"
                    r[key] = {"fused_fp32": err_stats(fused32(*a32, streaming), ref),
                              "eager_bf16": err_stats(est16(*a16, streaming), ref),
                              "fused_bf16": err_stats(fused16(*a16, streaming), ref)}
        return r

    def padding() -> dict:
        r = {}
        valid = [206, 131, 0, 77]
        with torch.inference_mode():
            for dtype, fused in ((torch.float32, fused32), (torch.bfloat16, fused16)):
                a = estimator_inputs(cfg, 4, 206, dtype, valid=valid, seed=1)
                for streaming in (True, False):
                    outb = fused(*a, streaming)
                    worst = 0.0
                    for row, n in enumerate(valid):
                        if n == 0:
                            worst = max(worst, outb[row].float().abs().max().item())  # must be exactly 0
                            continue
                        alone = fused(*(z[row:row + 1, ..., :n] if z.dim() == 3 else z[row:row + 1] for z in a),
                                      streaming)
                        worst = max(worst, (outb[row:row + 1, :, :n] - alone).float().abs().max().item())
                    r[f"{str(dtype)[6:]}_{'chunk' if streaming else 'full'}"] = {
                        "max_abs_diff_padded_vs_alone": worst, "finite": bool(torch.isfinite(outb).all())}
        return r

    def solve() -> dict:
        frames = 206
        g = torch.Generator().manual_seed(5)
        mu = torch.randn(1, 80, frames, generator=g).cuda()
        spks = torch.randn(1, 80, generator=g).cuda()
        cond = torch.zeros(1, 80, frames).cuda()
        cond[:, :, :60] = torch.randn(1, 80, 60, generator=g).cuda()
        mask = torch.ones(1, 1, frames).cuda()
        r = {}
        with torch.inference_mode():
            ref = cfm32.solve_batch(mu, mask, spks, cond, streaming=True)
            r["fused_fp32"] = err_stats(cfm32.solve_batch(mu, mask, spks, cond, streaming=True, estimator=fused32), ref)
            b = [z.to(torch.bfloat16) for z in (mu, mask, spks, cond)]
            r["eager_bf16"] = err_stats(cfm16.solve_batch(*b, streaming=True), ref)
            r["fused_bf16"] = err_stats(cfm16.solve_batch(*b, streaming=True, estimator=fused16), ref)
        return r

    def kernels() -> dict:
        # every mode but "whole_row_ln" splits the ResNet LayerNorms at 2 rows (SPLIT_LN_MAX_ROWS)
        n, mid, tail = cfg.n_blocks, cfg.num_mid_blocks, estimator_common.LAUNCH["conv_tail"]
        r = {"expected_fused": kernels_per_forward(n, mid, resnet_split_ln=True, conv_tail=tail),
             "expected_fused_one_kernel_ffn": kernels_per_forward(n, mid, True, resnet_split_ln=True, conv_tail=tail),
             "expected_fused_attn_out": kernels_per_forward(n, mid, False, True, True, tail),
             "expected_fused_attn_out_split_ln": kernels_per_forward(n, mid, False, True, True, tail),
             "expected_fused_whole_row_ln": kernels_per_forward(n, mid)}
        with torch.inference_mode():
            for frames in (56, 206):
                a = estimator_inputs(cfg, 2, frames, torch.bfloat16)
                for name, mod in (("cudagraph", est16), *fused_modes):
                    mod(*a, True)
                    r[f"{name}_{frames}"] = count_kernels(lambda: mod(*a, True))  # noqa: B023
        return r

    shapes = ((2, 56, True), (2, 206, True), (2, 206, False), (8, 206, True))

    def timing() -> dict:
        r = {}
        with torch.inference_mode():
            for rows, frames, streaming in shapes:
                a = estimator_inputs(cfg, rows, frames, torch.bfloat16)
                key = f"rows{rows}_{frames}_{'chunk' if streaming else 'full'}"
                r[key] = {name: round(graph_replay_ms(lambda: mod(*a, streaming), iters=args.iters), 4)  # noqa: B023
                          for name, mod in (("cudagraph", est16), *fused_modes)}
        return r

    def timeline() -> dict:
        """Per-kernel GPU time of one fused forward (launch order), summed by position in the block pattern."""
        r = {}
        with torch.inference_mode():
            for frames in (56, 206):
                a = estimator_inputs(cfg, 2, frames, torch.bfloat16)
                fused16(*a, True)
                kt = kernel_times(lambda: fused16(*a, True))  # noqa: B023
                total = sum(us for _, us in kt)
                by_name: dict[str, list] = {}
                for name, us in kt:
                    e = by_name.setdefault(name[:40], [0, 0.0])
                    e[0] += 1
                    e[1] += us
                # first ResNet block and first transformer block, kernel by kernel (after 3 temb + pack)
                r[f"2x{frames}"] = {"kernels": len(kt), "sum_kernel_us": round(total, 1),
                                    "by_name_count_us": {k: [v[0], round(v[1], 1)] for k, v in by_name.items()},
                                    "first_blocks_us": [[n[:24], round(us, 2)] for n, us in kt[:12]]}
        return r

    def variants() -> dict:
        r = {}
        lin0, conv0 = dict(estimator_linear.TUNING), dict(estimator_conv.TUNING)
        with torch.inference_mode():
            for vname, (lin, conv) in VARIANTS.items():
                estimator_linear.TUNING.update(lin)
                estimator_conv.TUNING.update(conv)
                try:
                    for rows, frames, streaming in shapes:
                        a = estimator_inputs(cfg, rows, frames, torch.bfloat16)
                        ms = graph_replay_ms(lambda: fused16(*a, streaming), iters=args.iters)  # noqa: B023
                        r[f"{vname}_rows{rows}_{frames}_{'chunk' if streaming else 'full'}"] = round(ms, 4)
                except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                    r[vname] = f"{type(e).__name__}: {e}"[:200]
                finally:
                    estimator_linear.TUNING.clear()
                    estimator_linear.TUNING.update(lin0)
                    estimator_conv.TUNING.clear()
                    estimator_conv.TUNING.update(conv0)
        return r

    def launch() -> dict:
        r = {}
        saved = dict(estimator_common.LAUNCH)
        modes = [(n, m) for n, m in fused_modes if "one_kernel" not in n]
        with torch.inference_mode():
            try:
                for lname, settings in LAUNCHES.items():
                    if args.launches and lname not in args.launches.split(","):
                        continue
                    estimator_common.LAUNCH.update(settings)
                    for rows, frames, streaming in shapes:
                        a = estimator_inputs(cfg, rows, frames, torch.bfloat16)
                        key = f"rows{rows}_{frames}_{'chunk' if streaming else 'full'}"
                        for name, mod in modes:
                            ms = graph_replay_ms(lambda: mod(*a, streaming), iters=args.iters)  # noqa: B023
                            r.setdefault(lname, {}).setdefault(key, {})[name] = round(ms, 4)
            finally:
                estimator_common.LAUNCH.update(saved)
        return r

    def temb() -> dict:
        """The time embedding's three GEMMs alone (sinusoid -> SiLU -> linear -> Mish -> every ResNet block's
        projection), graph-replayed, the default routing (``linear_2`` one-shot, the Mish GEMM row-tiled) against
        the row-tiled kernel everywhere; three passes in turn."""
        p = fused16.packed()
        tm = est16.time_mlp
        settings = {"default": {"oneshot": True}, "rowtiled": {"oneshot": False}}
        saved = dict(estimator_common.LAUNCH)
        r: dict = {}

        def chain(t: torch.Tensor) -> torch.Tensor:
            e = estimator_linear.linear(t, tm.linear_1.weight, tm.linear_1.bias,
                                        prologue=estimator_linear.PRO_SINUS, act=estimator_linear.ACT_SILU,
                                        freqs=p["freqs"])
            e = estimator_linear.linear(e, tm.linear_2.weight, tm.linear_2.bias)
            return estimator_linear.linear(e, p["temb_w"], p["temb_b"], prologue=estimator_linear.PRO_MISH)

        with torch.inference_mode():
            try:
                for rnd in range(3):
                    for sname, change in settings.items():
                        estimator_common.LAUNCH.update(change)
                        for rows in (2, 32):
                            t = torch.full((rows,), 0.3, device="cuda", dtype=torch.bfloat16)
                            ms = graph_replay_ms(lambda: chain(t), iters=args.iters)  # noqa: B023
                            r.setdefault(sname, {}).setdefault(f"rows{rows}", []).append(round(ms * 1e3, 2))
            finally:
                estimator_common.LAUNCH.update(saved)
        return r

    def oneshot_rows() -> dict:
        """One CFG pair's forward (chunk attention) at the engine's few-rows bucket lengths, row-tiled GEMMs
        against one-shot ones at any row count, alternating, two passes: where ``oneshot_max_rows`` belongs."""
        saved = dict(estimator_common.LAUNCH)
        r: dict = {}
        with torch.inference_mode():
            try:
                for _ in range(2):
                    for frames in (56, 100, 150, 200, 206, 250):
                        a = estimator_inputs(cfg, 2, frames, torch.bfloat16)
                        for sname, oneshot in (("rowtiled", False), ("oneshot", True)):
                            estimator_common.LAUNCH.update(oneshot=oneshot, oneshot_max_rows=1 << 30)
                            ms = graph_replay_ms(lambda: fused16(*a, True), iters=args.iters)  # noqa: B023
                            r.setdefault(f"2x{frames}", {}).setdefault(sname, []).append(round(ms, 4))
            finally:
                estimator_common.LAUNCH.update(saved)
        return r

    steps = (("errors", "estimator_errors", estimator_errors), ("padding", "padding", padding),
             ("solve", "solve_mel_errors", solve), ("kernels", "kernels", kernels),
             ("timing", "timing_ms_bf16", timing), ("timeline", "kernel_timeline_bf16", timeline),
             ("variants", "variants_ms_bf16", variants), ("launch", "launch_ms_bf16", launch),
             ("temb", "temb_chain_us_bf16", temb), ("oneshot_rows", "oneshot_rows_ms_bf16", oneshot_rows))
    for short, name, fn in steps:
        if not only or short in only:
            runner.run(name, fn)

    print("\n== fused flow estimator, %s, bf16 unless noted ==" % res["device"])
    k = res.get("kernels", {})
    for frames in (56, 206):
        print(f"kernels/forward {frames} frames: " + "  ".join(
            f"{name} {k.get(f'{name}_{frames}')}" for name in ("cudagraph", "fused", "fused_one_kernel_ffn",
                                                               "fused_attn_out", "fused_attn_out_one_kernel_ffn",
                                                               "fused_attn_out_split_ln", "fused_whole_row_ln")))
    for key, v in res.get("timing_ms_bf16", {}).items():
        print(f"graph replay ms {key}: {v}")
    for key, v in res.get("variants_ms_bf16", {}).items():
        print(f"variant {key}: {v} ms")
    for lname, by_shape in res.get("launch_ms_bf16", {}).items():
        if isinstance(by_shape, dict):
            for key, v in by_shape.items():
                print(f"launch {lname} {key}: {v} ms")
    for key, v in res.get("temb_chain_us_bf16", {}).items():
        print(f"time-embedding chain {key}: {v} us")
    for key, v in res.get("kernel_timeline_bf16", {}).items():
        if "kernels" in v:
            print(f"timeline {key}: {v['kernels']} kernels, sum of kernel times {v['sum_kernel_us']} us")
    for key, v in res.get("solve_mel_errors", {}).items():
        if "max" in v:
            print(f"mel (10-step solve, 206 fr) {key}: max {v['max']:.3g} p99.9 {v['p99.9']:.3g} mean {v['mean']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
