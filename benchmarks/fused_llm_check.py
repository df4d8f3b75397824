"""One GPU call for the fused LLM backend at full size (CosyVoice2-0.5B shapes, seeded random weights):

1. correctness of one decode step against eager (fp32: max error; bf16: error vs the fp32 step, fused and eager),
   with and without programmatic dependent launch (PDL) between the fused kernels;
2. kernels per step, the costliest kernels and decode-step GPU time as CUDA-graph replays, ``cudagraph`` vs
   ``fused`` math (PDL off and on), at 1 and 16 rows, with achieved GB/s against the H100's 3.35 TB/s
   (:mod:`cosyvoice_fast.bench.profile_llm`);
3. the fused backend end to end with PDL (``generate``, sampling and the per-step host sync included): ms per
   token at 1 and 16 requests (token parity with eager is tests/test_fused_llm.py's job);
4. three tile variants of the fused kernels at the same shapes (each compiles a handful of kernels, no sweep).

    PYTHONUNBUFFERED=1 python benchmarks/fused_llm_check.py --out $OUT [--skip-backends] [--step-timeout S]

Each section is a step under its own time limit, and results go to ``$OUT/fused_llm_check.json`` after every
measurement (:mod:`benchmarks.steps`: a section that times out or fails keeps what was done and the next one
runs); a short table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.bench import profile_llm  # noqa: E402
from cosyvoice_fast.config.model import full_config  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_proj  # noqa: E402
from cosyvoice_fast.llm.kernels.qwen2_decode import decode_step  # noqa: E402
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM  # noqa: E402
from cosyvoice_fast.frontend.request import ModelInputs  # noqa: E402

CONTEXT, MAX_LEN, BUCKET = 300, 1024, 512  # a row ~300 positions in (prompt + text + ~150 tokens)


def random_lm(dtype: torch.dtype) -> Qwen2LM:
    """CosyVoice2-0.5B shapes with seeded random weights (:func:`cosyvoice_fast.modeldir.synthetic.random_full_size_lm`)."""
    from cosyvoice_fast.modeldir.synthetic import random_full_size_lm

    return random_full_size_lm(dtype)


def step(lm: Qwen2LM, fused: bool, x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cache = lm.new_cache(kv.shape[4], batch=x.shape[0])
    for i in range(len(cache.k)):
        cache.k[i].copy_(kv[0, i])
        cache.v[i].copy_(kv[1, i])
    with torch.inference_mode():
        if fused:
            return decode_step(lm.decoder, x, pos, cache, BUCKET).float()
        return lm.decoder(x, pos, cache, kv_len=BUCKET).float()


def err_stats(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a - ref).abs().flatten()
    return {"max": d.max().item(), "p99.9": d.quantile(0.999).item(), "mean": d.mean().item()}


def correctness(lm32: Qwen2LM, lm16: Qwen2LM, rows: int) -> dict:
    q = lm32.decoder.cfg
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1, q.hidden_size, generator=g) * 0.05).cuda()
    kv = torch.randn(2, q.num_hidden_layers, rows, q.num_key_value_heads, BUCKET, q.head_dim, generator=g)
    kv = kv.to(torch.bfloat16).cuda()  # bf16-representable, so the fp32 runs see the same values
    pos = (CONTEXT - 1 - torch.arange(rows)).view(rows, 1).cuda()
    x = x.to(torch.bfloat16)
    ref = step(lm32, False, x.float(), kv.float(), pos)
    out = {"rows": rows, "fp32": err_stats(step(lm32, True, x.float(), kv.float(), pos), ref),
           "bf16_fused": err_stats(step(lm16, True, x, kv, pos), ref),
           "bf16_eager": err_stats(step(lm16, False, x, kv, pos), ref)}
    out["fp32_ok"] = out["fp32"]["max"] <= 1e-4
    return out


def backends(lm: Qwen2LM, names: list[str], results: dict, save: Callable[[], None]) -> None:
    """ms per token of the whole backends (``fused`` runs under the current ``qwen2_proj.TILES``)."""
    from cosyvoice_fast.llm.graph import CudaGraphLLM
    from cosyvoice_fast.llm.fused import FusedLLM

    cfg = full_config()
    text = torch.arange(100, 130, dtype=torch.int32)[None]
    inputs = ModelInputs(text_segments=[text], prompt_text=torch.arange(200, 220)[None],
                         llm_prompt_speech_token=torch.arange(75)[None] * 37 % 6561)
    for name in names:
        cls = CudaGraphLLM if name == "cudagraph" else FusedLLM
        t = time.perf_counter()
        stage = cls(lm, cfg, slots=16, max_len=MAX_LEN, prefill_buckets=(256,), progress=False)
        row = {"backend": name, "tiles": repr(qwen2_proj.TILES), "dtype": "bf16",
               "build_s": round(time.perf_counter() - t, 1)}
        for rows in (1, 16):
            profile_llm.backend_ms_per_token(stage, inputs, text, rows, 20)  # warm
            row[f"ms_per_token_rows{rows}"] = round(profile_llm.backend_ms_per_token(stage, inputs, text, rows, 150), 4)
        results["backends"].append(row)
        print(row, flush=True)
        save()
        del stage
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="directory; results go to OUT/fused_llm_check.json")
    ap.add_argument("--skip-backends", action="store_true")
    ap.add_argument("--step-timeout", type=int, default=300, help="seconds per section")
    a = ap.parse_args()
    require_cuda("fused_llm_check.py")
    import triton

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "context": CONTEXT, "bucket": BUCKET, "correctness": [], "steps": [], "tiles": [],
                     "backends": [], "triton": triton.__version__}
    runner = StepRunner(Path(a.out) / "fused_llm_check.json", results, step_timeout=a.step_timeout)
    save = runner.save
    lm32 = random_lm(torch.float32)
    lm16 = copy.deepcopy(lm32).to(torch.bfloat16)
    plain = qwen2_proj.TILES
    pdl = dataclasses.replace(plain, pdl=True)

    def run_correctness(lm32: Qwen2LM) -> None:
        try:
            for tiles in (plain, pdl):
                qwen2_proj.TILES = tiles
                for rows in (1, 16):
                    results["correctness"].append({"tiles": repr(tiles), **correctness(lm32, lm16, rows)})
                    print("correctness", results["correctness"][-1], flush=True)
                    save()
        finally:
            qwen2_proj.TILES = plain

    def run_step_profiles() -> None:
        try:
            for backend, tiles in (("cudagraph", plain), ("fused", plain), ("fused", pdl)):
                qwen2_proj.TILES = tiles
                for rows in (1, 16):
                    p = profile_llm.step_profile(lm16, backend, rows, CONTEXT, MAX_LEN, BUCKET)
                    results["steps"].append({**p.as_dict(), "pdl": tiles.pdl})
                    print(p, flush=True)
                    save()
        finally:
            qwen2_proj.TILES = plain

    def run_backends() -> None:
        try:
            qwen2_proj.TILES = pdl
            backends(lm16, ["fused"], results, save)
        finally:
            qwen2_proj.TILES = plain

    def run_tile_variants() -> None:
        variants = {"pdl_k512": dataclasses.replace(pdl, k_bytes=512),
                    "pdl_down8": dataclasses.replace(pdl, down_split=8),
                    "pdl_gate_up16": dataclasses.replace(pdl, gate_up=16)}
        try:
            for vname, tiles in variants.items():
                qwen2_proj.TILES = tiles
                for rows in (1, 16):
                    fn = profile_llm.decode_math(lm16, "fused", rows, CONTEXT, MAX_LEN, BUCKET)
                    results["tiles"].append({"variant": vname, "tiles": repr(tiles), "rows": rows,
                                             "graph_ms": round(profile_llm.graph_ms(fn), 4)})
                    print(results["tiles"][-1], flush=True)
                    save()
        finally:
            qwen2_proj.TILES = plain

    runner.run("correctness", functools.partial(run_correctness, lm32), store=False)
    del lm32  # the fp32 model is only the correctness reference
    torch.cuda.empty_cache()
    runner.run("step_profiles", run_step_profiles, store=False)
    pdl_ok = runner.ok("correctness") and all(c["fp32_ok"] for c in results["correctness"])
    if not a.skip_backends and pdl_ok:
        runner.run("backends", run_backends, store=False)
    runner.run("tile_variants", run_tile_variants, store=False)
    print("\nrows | backend   | pdl | kernels/step | kernel ms | graph ms/step | GB/s  | % of 3.35 TB/s")
    for s in results["steps"]:
        print(f"{s['rows']:4d} | {s['backend']:9s} | {s['pdl']:d}   | {s['kernels']:12d} | {s['kernel_ms']:9.3f} | "
              f"{s['graph_ms']:13.3f} | {s['gbs']:5.0f} | {100 * s['peak_fraction']:.0f}%")
    for s in results["steps"]:
        if s["backend"] == "fused":
            print(f"fused rows {s['rows']} pdl {s['pdl']:d}:", s["by_kernel"])
    for c in results["correctness"]:
        print(f"{c['tiles'][-25:]} rows {c['rows']}: fp32 max err {c['fp32']['max']:.2e}; "
              f"bf16 max err fused {c['bf16_fused']['max']:.2e}"
              f" eager {c['bf16_eager']['max']:.2e}")
    for b in results["backends"]:
        print(f"backend {b['backend']} {b['dtype']} {b['tiles'][-25:]}: {b['ms_per_token_rows1']} ms/token at 1 "
              f"row, {b['ms_per_token_rows16']} ms per 16-row step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
