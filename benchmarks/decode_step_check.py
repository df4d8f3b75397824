"""One GPU call for the fused decode step at CosyVoice2-0.5B shapes (seeded random weights): the one-row GEMV
kernels (weights loaded before the PDL wait, :mod:`cosyvoice_fast.llm.kernels.qwen2_gemv`) against the looped ones.

    PYTHONUNBUFFERED=1 python benchmarks/decode_step_check.py --out $OUT [--graph-only] [--budget S]

1. ``correctness``: one step's final hidden states and K/V against eager fp32 (fp32 step: max error; bf16
   step: max / p99.9 / mean against the same, and eager bf16's for scale), rows 1, 4, 16, 40;
2. ``graph``: ms per decode step replayed as a CUDA graph (bf16, rows at ~300 positions, KV bucket 512), rows
   1..64, default tiles, ``gemv=False`` (one row on the looped kernels too) and ``early_tile=False`` (no weight
   tile loaded before the PDL wait), with achieved GB/s;
   per-kernel GPU time (torch.profiler) at rows 1 and 16;
3. ``backend``: the ``fused`` LLM backend end to end, wall ms per token at 1 and 16 requests (sampling and the
   per-step host sync included), the host time of each step's launches, and the GPU time of the whole decode
   graph (embedding, decoder, speech head, nucleus draw) per KV bucket;
4. ``variants``: a handful of named settings of the decode attention (programs to aim for, keys per tile);
5. ``gemv``: the one-row step under named GEMV settings (columns per program of the ~2 MB q/k/v and
   o-projection matrices apart from the big ones, K pieces of the down projection), three passes in turn
   so that drift between passes shows;
6. ``gemv_rows``: steps of 1..16 rows on the looped kernels and on the GEMV kernels (``Tiles.gemv_rows``),
   and the GEMV step's error at 4 and 16 rows.
7. ``cublas_rows``: steps of 1..64 rows on the fused projections and on cuBLAS GEMMs with the Triton glue
   (``Tiles.cublas_rows``), two passes in turn.

``--steps gemv,graph`` runs only the named steps (default: all).

``--graph-only`` runs step 2 with the default tiles only, which also works on code from before the GEMV
kernels (run it from a copy of that tree for a same-machine baseline).  Results: ``OUT/decode_step_check.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.bench import profile_llm  # noqa: E402
from cosyvoice_fast.llm.kernels import qwen2_proj  # noqa: E402

CONTEXT, MAX_LEN, BUCKET = 300, 1024, 512
ROWS = (1, 2, 4, 8, 16, 32, 64)
GEMV_VARIANTS = {"default": {}, "small4": {"gemv_small_cols": 4}, "small2": {"gemv_small_cols": 2},
                 "small16": {"gemv_small_cols": 16}, "small4_chunk256": {"gemv_small_cols": 4, "down_chunk": 256},
                 "small4_cols4": {"gemv_small_cols": 4, "gemv_cols": 4},
                 "small4_cols16": {"gemv_small_cols": 4, "gemv_cols": 16}}
VARIANTS = {"attn_programs128": {"attn_programs": 128}, "attn_programs256": {"attn_programs": 256},
            "attn_programs512": {"attn_programs": 512}, "attn_keys64": {"attn_keys": 64},
            "attn_programs16_keys64": {"attn_programs": 16, "attn_keys": 64}}


def _lm(dtype: torch.dtype) -> torch.nn.Module:
    from cosyvoice_fast.modeldir.synthetic import random_full_size_lm

    return random_full_size_lm(dtype)


def _stats(a: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (a.float() - ref.float()).abs().flatten()
    k = max(1, int(round(0.999 * d.numel())))
    return {"max": d.max().item(), "p99.9": d.kthvalue(k).values.item(), "mean": d.mean().item()}


def _step(lm: torch.nn.Module, fused: bool, x: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor) -> tuple:
    h, cache = profile_llm.step_over_cache(lm, fused, x, kv, pos, BUCKET)
    rows = torch.arange(x.shape[0], device=x.device)
    written = torch.stack([torch.stack([c[rows, :, pos[:, 0]] for c in cache.k]),
                           torch.stack([c[rows, :, pos[:, 0]] for c in cache.v])])
    return h.float(), written.float()


def correctness(lm32: torch.nn.Module, lm16: torch.nn.Module, rows: int) -> dict:
    q = lm32.decoder.cfg
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1, q.hidden_size, generator=g) * 0.05).to(torch.bfloat16).cuda()
    kv = torch.randn(2, q.num_hidden_layers, rows, q.num_key_value_heads, BUCKET, q.head_dim, generator=g)
    kv = kv.to(torch.bfloat16).cuda()  # bf16-representable, so the fp32 runs see the same values
    pos = (CONTEXT - 1 - torch.arange(rows)).view(rows, 1).cuda()
    ref_h, ref_kv = _step(lm32, False, x.float(), kv.float(), pos)
    f32_h, f32_kv = _step(lm32, True, x.float(), kv.float(), pos)
    f16_h, f16_kv = _step(lm16, True, x, kv, pos)
    e16_h, _ = _step(lm16, False, x, kv, pos)
    out = {"rows": rows, "gemv": rows <= qwen2_proj.TILES.gemv_rows and qwen2_proj.TILES.gemv,
           "fp32_hidden_max": (f32_h - ref_h).abs().max().item(), "fp32_kv_max": (f32_kv - ref_kv).abs().max().item(),
           "bf16_fused": _stats(f16_h, ref_h), "bf16_eager": _stats(e16_h, ref_h),
           "bf16_fused_kv_max": (f16_kv - ref_kv).abs().max().item()}
    out["fp32_ok"] = max(out["fp32_hidden_max"], out["fp32_kv_max"]) <= 1e-4
    return out


def graph_rows(lm16: torch.nn.Module, label: str, results: dict, save, profile_rows=(1, 16)) -> None:  # noqa: ANN001
    for rows in ROWS:
        fn = profile_llm.decode_math(lm16, "fused", rows, CONTEXT, MAX_LEN, BUCKET)
        ms = profile_llm.graph_ms(fn)
        mb = profile_llm.decoder_bytes(lm16, rows, CONTEXT) / 1e6
        row = {"label": label, "tiles": repr(qwen2_proj.TILES), "rows": rows, "graph_ms": round(ms, 4),
               "gbs": round(mb / ms, 1)}
        if rows in profile_rows:
            kernels, kernel_ms, top = profile_llm.kernel_profile(fn)
            row.update(kernels=kernels, kernel_ms=round(kernel_ms, 4), by_kernel=top)
        results["graph"].append(row)
        print(row, flush=True)
        save()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="directory; results go to OUT/decode_step_check.json")
    ap.add_argument("--graph-only", action="store_true", help="step 2 with the default tiles only")
    ap.add_argument("--label", default="new", help="names this tree's rows in the JSON")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole script")
    ap.add_argument("--steps", default="correctness,graph,backend,variants,gemv", help="steps to run")
    a = ap.parse_args()
    steps = set(a.steps.split(","))
    require_cuda("decode_step_check.py")
    import triton

    out = Path(a.out) / ("decode_step_check.json" if not a.graph_only else f"decode_step_graph_{a.label}.json")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "context": CONTEXT, "bucket": BUCKET, "correctness": [], "graph": [], "variants": [],
                     "backend": [], "gemv": [], "gemv_rows": [], "cublas_rows": []}
    runner = StepRunner(out, results, step_timeout=240, budget_s=a.budget)
    lm16 = _lm(torch.bfloat16)
    default = qwen2_proj.TILES
    if a.graph_only:
        runner.run("graph", lambda: graph_rows(lm16, a.label, results, runner.save), store=False)
        return 0

    def run_correctness() -> None:
        lm32 = _lm(torch.float32)
        lm16_same = copy.deepcopy(lm32).to(torch.bfloat16)
        for rows in (1, 4, 16, 40):
            results["correctness"].append(correctness(lm32, lm16_same, rows))
            print(results["correctness"][-1], flush=True)
            runner.save()

    def run_graph() -> None:
        try:
            graph_rows(lm16, a.label, results, runner.save)
            qwen2_proj.TILES = dataclasses.replace(default, gemv=False)
            graph_rows(lm16, a.label + "_looped", results, runner.save, profile_rows=(1,))
            qwen2_proj.TILES = dataclasses.replace(default, early_tile=False)
            graph_rows(lm16, a.label + "_late_tile", results, runner.save, profile_rows=())
        finally:
            qwen2_proj.TILES = default

    def run_variants() -> None:
        try:
            for name, change in VARIANTS.items():
                qwen2_proj.TILES = dataclasses.replace(default, **change)
                for rows in (1, 4, 16, 64):
                    fn = profile_llm.decode_math(lm16, "fused", rows, CONTEXT, MAX_LEN, BUCKET)
                    results["variants"].append({"variant": name, "rows": rows,
                                                "graph_ms": round(profile_llm.graph_ms(fn), 4)})
                    print(results["variants"][-1], flush=True)
                    runner.save()
        finally:
            qwen2_proj.TILES = default

    def run_backend() -> None:
        from cosyvoice_fast.llm.fused import FusedLLM
        from cosyvoice_fast.config.model import full_config
        from cosyvoice_fast.frontend.request import ModelInputs

        text = torch.arange(100, 130, dtype=torch.int32)[None]
        inputs = ModelInputs(text_segments=[text], prompt_text=torch.arange(200, 220)[None],
                             llm_prompt_speech_token=torch.arange(75)[None] * 37 % 6561)
        t = time.perf_counter()
        stage = FusedLLM(lm16, full_config(), slots=16, max_len=MAX_LEN, progress=False)
        row: dict = {"build_s": round(time.perf_counter() - t, 1), "buckets": list(stage.buckets)}
        name = "_launch" if stage.device_ras else "_replay_rows"  # the step's launch: inputs, draws, replay
        replay = getattr(stage, name)
        host = [0.0]

        def timed_replay(*args):  # noqa: ANN002, ANN202 - host time of the step's launches
            t0 = time.perf_counter()
            replay(*args)
            host[0] += time.perf_counter() - t0

        setattr(stage, name, timed_replay)
        for rows in (1, 16):
            profile_llm.backend_ms_per_token(stage, inputs, text, rows, 20)  # warm
            host[0] = 0.0
            row[f"ms_per_token_rows{rows}"] = round(profile_llm.backend_ms_per_token(stage, inputs, text, rows, 150), 4)
            row[f"replay_host_ms_rows{rows}"] = round(host[0] * 1e3 / 149, 4)
            for b in stage.buckets:  # the whole decode graph (embedding, decoder, head, nucleus draw) alone
                row[f"graph_ms_rows{rows}_kv{b}"] = round(profile_llm.replay_ms(stage._batch_graphs[b, rows], 50), 4)
        results["backend"].append(row)
        print(row, flush=True)

    def run_gemv() -> None:
        fn = profile_llm.decode_math(lm16, "fused", 1, CONTEXT, MAX_LEN, BUCKET)
        try:
            for rnd in range(3):
                for name, change in GEMV_VARIANTS.items():
                    qwen2_proj.TILES = dataclasses.replace(default, **change)
                    results["gemv"].append({"variant": name, "pass": rnd, "rows": 1,
                                            "graph_ms": round(profile_llm.graph_ms(fn, iters=200), 4)})
                    print(results["gemv"][-1], flush=True)
                    runner.save()
        finally:
            qwen2_proj.TILES = default

    def rows_ab(key: str, rows_list: tuple[int, ...], settings: dict[str, dict]) -> None:
        """Two passes in turn: per row count, the decoder step's graph ms under each named ``Tiles`` change,
        appended to ``results[key]``."""
        try:
            for rnd in range(2):
                for rows in rows_list:
                    fn = profile_llm.decode_math(lm16, "fused", rows, CONTEXT, MAX_LEN, BUCKET)
                    for name, change in settings.items():
                        qwen2_proj.TILES = dataclasses.replace(default, **change)
                        results[key].append({"kernels": name, "pass": rnd, "rows": rows,
                                             "graph_ms": round(profile_llm.graph_ms(fn, iters=200), 4)})
                        print(results[key][-1], flush=True)
                        runner.save()
        finally:
            qwen2_proj.TILES = default

    def run_gemv_rows() -> None:
        """Steps of 1..16 rows on the looped kernels against the GEMV kernels (``Tiles.gemv_rows``), and the
        GEMV step's fp32 error against eager at 4 and 16 rows."""
        rows_ab("gemv_rows", (1, 2, 4, 8, 16), {"looped": {"gemv_rows": 1}, "gemv": {"gemv_rows": 16}})
        lm32 = _lm(torch.float32)
        lm16_same = copy.deepcopy(lm32).to(torch.bfloat16)
        try:
            qwen2_proj.TILES = dataclasses.replace(default, gemv_rows=16)
            for rows in (4, 16):
                results["gemv_rows"].append({"correctness": correctness(lm32, lm16_same, rows)})
                print(results["gemv_rows"][-1], flush=True)
        finally:
            qwen2_proj.TILES = default

    def run_cublas_rows() -> None:
        """Steps of 1..64 rows on the fused projections against cuBLAS GEMMs with the Triton glue
        (``Tiles.cublas_rows``, :func:`cosyvoice_fast.llm.kernels.qwen2_hybrid.decode_rows`)."""
        rows_ab("cublas_rows", (1, 2, 4, 8, 16, 32, 64), {"fused": {"cublas_rows": 0}, "cublas": {"cublas_rows": 1}})

    for name, fn in (("correctness", run_correctness), ("graph", run_graph), ("backend", run_backend),
                     ("variants", run_variants), ("gemv", run_gemv), ("gemv_rows", run_gemv_rows),
                     ("cublas_rows", run_cublas_rows)):
        if name in steps:
            # building the 16-slot stage (every bucket and row count captured) took more than 240 s in session 30
            runner.run(name, fn, store=False, timeout=540 if name == "backend" else None)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
