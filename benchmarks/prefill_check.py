"""One GPU call for the fused prefill (:mod:`cosyvoice_fast.llm.kernels.qwen2_hybrid`) at CosyVoice2-0.5B shapes
(seeded random weights) against the graph-replayed prefill of the model's own decoder.

    PYTHONUNBUFFERED=1 python benchmarks/prefill_check.py --out $OUT [--steps errors,graphs,kernels]

1. ``errors``: prompts of 128 positions (two, ending at 127 and 100) into slot rows of a pool: the fused
   prefill in fp32 against the decoder's own cached prefill of each prompt alone in fp32 (final hidden state at
   the prompt's last position, keys/values of every position: max error), and in bf16 (max / p99.9 / mean
   against the fp32 reference, beside the decoder's own bf16 prefill against the same reference);
2. ``graphs``: GPU ms per replay of the batched prefill graphs of the ``fused`` LLM backend with
   ``fused_prefill`` on and off (bf16, 16 slots, buckets 64..512), per (padded length, rows);
3. ``kernels``: launches per prefill call (torch.profiler over one uncaptured call) for both.

Results: ``OUT/prefill_check.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import replay_median_ms  # noqa: E402

SHAPES = ((64, 1), (128, 1), (256, 1), (512, 1), (128, 4), (128, 16), (256, 16))


def _stats(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a.float() - ref.float()).abs().flatten()
    k = max(1, int(round(0.999 * d.numel())))
    return {"max": d.max().item(), "p99.9": d.kthvalue(k).values.item(), "mean": d.mean().item()}


def errors() -> dict:
    from cosyvoice_fast.llm.kernels.qwen2_hybrid import prefill_rows
    from cosyvoice_fast.llm.model.qwen2 import KVCache
    from cosyvoice_fast.modeldir.synthetic import random_full_size_lm

    out: dict = {}
    length, slots, last = 128, torch.tensor([3, 1], device="cuda"), torch.tensor([127, 100], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x32 = torch.randn(2, length, 896, device="cuda", generator=g) * 0.05
    ref_h, ref_kv = [], []
    lm32 = random_full_size_lm(torch.float32)
    dec32 = lm32.decoder.fuse_projections()
    cfg = dec32.cfg
    for r in range(2):
        c = KVCache.for_config(cfg, 256, 1, torch.float32, "cuda")
        ref_h.append(dec32(x32[r:r + 1], torch.arange(length, device="cuda"), c, kv_len=length)[0, int(last[r])])
        ref_kv.append([t[0, :, :length].clone() for t in c.k + c.v])
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        lm = lm32 if dtype == torch.float32 else random_full_size_lm(dtype)
        dec = lm.decoder.fuse_projections()
        pool = KVCache.for_config(cfg, 256, 4, dtype, "cuda")
        got = prefill_rows(dec, x32.to(dtype), slots, last, pool)
        torch.cuda.synchronize()
        h = torch.stack(ref_h)
        res = {"hidden": _stats(got, h),
               "kv": _stats(torch.cat([torch.cat([t[int(s), :, :length] for t in pool.k + pool.v])
                                       for s in slots.tolist()]),
                            torch.cat([torch.cat(kv) for kv in ref_kv]))}
        if dtype != torch.float32:
            own = []
            for r in range(2):
                c = KVCache.for_config(cfg, 256, 1, dtype, "cuda")
                own.append(dec(x32[r:r + 1].to(dtype), torch.arange(length, device="cuda"), c,
                               kv_len=length)[0, int(last[r])])
            res["decoder_own_bf16_hidden"] = _stats(torch.stack(own), h)
        out[name] = res
        del lm
    return out


def _stages() -> dict:
    from cosyvoice_fast.llm.fused import FusedLLM
    from cosyvoice_fast.modeldir.synthetic import full_config, random_full_size_lm

    lm = random_full_size_lm(torch.bfloat16)
    return {name: FusedLLM(lm, full_config(), slots=16, max_len=2048, progress=False, fused_prefill=fused)
            for name, fused in (("fused_prefill", True), ("model_prefill", False))}


def graphs(stages: dict) -> dict:
    out: dict = {}
    for name, stage in stages.items():
        rows_out = {}
        for n, rows in SHAPES:
            graph = stage.prefiller.graphs.get((n, rows))
            if graph is None:
                rows_out[f"{n}x{rows}"] = None
                continue
            rows_out[f"{n}x{rows}"] = {"ms_p50": replay_median_ms(graph, iters=30)}
        out[name] = rows_out
    return out


@torch.inference_mode()
def kernels(stages: dict) -> dict:
    out: dict = {}
    for name, stage in stages.items():
        per = {}
        for n, rows in ((128, 1), (128, 16)):
            stage.prefiller._math(n, rows)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                stage.prefiller._math(n, rows)
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            per[f"{n}x{rows}"] = {"kernels": len(evs), "kernel_us": sum(e.device_time for e in evs)}
        out[name] = per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="errors,graphs,kernels")
    a = ap.parse_args()
    require_cuda("benchmarks/prefill_check.py")
    steps = a.steps.split(",")
    runner = StepRunner(Path(a.out) / "prefill_check.json", step_timeout=240)
    runner.results["gpu"] = torch.cuda.get_device_name()
    if "errors" in steps:
        runner.run("errors", errors)
    if "graphs" in steps or "kernels" in steps:
        stages = runner.run("build", _stages, store=False)
        if runner.ok("build"):
            for name, fn in (("graphs", graphs), ("kernels", kernels)):
                if name in steps:
                    runner.run(name, lambda fn=fn: fn(stages))


if __name__ == "__main__":
    main()
