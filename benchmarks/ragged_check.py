"""One GPU run: estimator graphs replayed over only their live rows and frames (ragged extents) against padding.

    PYTHONUNBUFFERED=1 python benchmarks/ragged_check.py --out $OUT/ragged_check.json

Full-size estimator (CosyVoice2 DecoderConfig), seeded random weights, the flow's real graph runner
(:class:`~cosyvoice_fast.flow.graph.GraphEstimator` with the engine's default buckets).  Each case is
one Euler step of a solve with ``live`` batch rows (CFG rows) x ``frames`` frames, served from the graph of its
(frames bucket, rows bucket); each is timed three ways, as the whole runner call (input copies + replay; median
ms of GPU time over 40 calls, each between its own events):

* ``padded``: the graph computes its whole bucket (the default runner);
* ``ragged``: the same graph, its kernels skip everything past the live extent (``ragged=True``);
* ``exact``: a graph captured at exactly the live frame count, same row bucket (one graph per length is not
  practical; a bound).

``errors`` compares ragged against padded (bf16 and fp32) and, in fp32, against the unpadded fused forward;
``profile`` shows why one request's pair gains nothing (kernel time per graph, against replay time).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import gpu_runner, step_args  # noqa: E402

# (name, CFG rows live, frames live, streaming): one request's CFG pair and batched solves of several requests at
# lengths that fall short of the engine's buckets (250, 400, 500), each within the runner's graph budget
# (rows x bucket^2 <= 2 x 1500^2: 16 rows at most at the 400- and 500-frame buckets).  The raw file of session 18
# names the first three cases c1_first_2x206, second_2x306 and final_2x450: labels from a wrong guess at the
# benchmark schedule, whose first chunk is 200 frames (BENCHMARKS.md)
CASES = [("pair_2x206", 2, 206, True), ("pair_2x306", 2, 306, True), ("pair_final_2x450", 2, 450, False),
         ("batch16_32x206", 32, 206, True), ("batch11_22x206", 22, 206, True), ("batch8_16x306", 16, 306, True),
         ("batch5_10x306", 10, 306, True), ("batch8_16x450", 16, 450, False), ("batch5_10x450", 10, 450, False)]
ERROR_CASES = ("pair_2x206", "batch11_22x206", "batch8_16x450")

def _runner(est: torch.nn.Module, ragged: bool):
    from cosyvoice_fast.flow.graph import GraphEstimator
    from cosyvoice_fast.config.engine import EngineConfig
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator

    return GraphEstimator(FusedEstimator(est), torch.device("cuda"), granularity=50,
                          buckets=EngineConfig().flow_buckets, ragged=ragged)


def _call_ms(runner, args: tuple, streaming: bool, iters: int = 40) -> float:
    with torch.inference_mode():
        for _ in range(3):
            runner(*args, streaming)
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner(*args, streaming)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return round(statistics.median(times), 4)


def _est(dtype: torch.dtype) -> torch.nn.Module:
    from cosyvoice_fast.config.model import DecoderConfig
    from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder

    torch.manual_seed(0)
    est = CausalConditionalDecoder(DecoderConfig()).to("cuda", dtype).eval()
    est.fuse_projections()
    return est


def step_timing() -> dict:
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs

    est = _est(torch.bfloat16)
    padded, ragged, exact = _runner(est, False), _runner(est, True), _runner(est, True)
    out = {}
    for name, rows, frames, streaming in CASES:
        args = estimator_inputs(est.cfg, rows, frames, torch.bfloat16)
        row = {"bucket_frames": padded.bucket(frames)}
        row["padded_ms"] = _call_ms(padded, args, streaming)
        row["ragged_ms"] = _call_ms(ragged, args, streaming)
        exact.buckets = (frames,)  # its graph: this exact length (rows still take their row bucket)
        exact.max_frames = max(frames, exact.max_frames)
        row["exact_ms"] = _call_ms(exact, args, streaming)
        row["ragged_vs_padded"] = round(row["ragged_ms"] / row["padded_ms"], 3)
        row["eager_calls"] = padded.eager_calls + ragged.eager_calls + exact.eager_calls
        out[name] = row
        print(name, row, flush=True)
    return out


def step_errors() -> dict:
    """Ragged against padded (bf16) and against the unpadded eager-free fused forward (fp32, TF32 off)."""
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs

    out = {}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float32):
        est = _est(dtype)
        padded, ragged = _runner(est, False), _runner(est, True)
        for name, rows, frames, streaming in (c for c in CASES if c[0] in ERROR_CASES):
            valid = [frames - 37 * (i % 3) for i in range(rows)]  # right-padded rows inside the solve too
            args = estimator_inputs(est.cfg, rows, frames, dtype, valid=valid)
            with torch.inference_mode():
                p, r = padded(*args, streaming), ragged(*args, streaming)
                assert padded.eager_calls == ragged.eager_calls == 0, "a case outside the graph budget"
                ref = FusedEstimator(est)(*args, streaming) if dtype == torch.float32 else p
            out[f"{name}_{str(dtype)[6:]}"] = {"max_vs_padded": (r - p).abs().max().item(),
                                               "max_vs_unpadded_forward": (r - ref).abs().max().item(),
                                               "finite": bool(torch.isfinite(r).all())}
    return out


def step_profile() -> dict:
    """Why a ragged replay of a few rows is slower than an exact-shape one: the forward at 2 x 206 live frames in
    the 250-frame bucket as four graphs (exact 206, padded 250, ragged 206 of 250, ragged with the whole bucket
    live), each with its replay time, kernel count and GPU time by kernel name."""
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs, graph_profile

    est = _est(torch.bfloat16)
    fused = FusedEstimator(est)
    live, cap = estimator_inputs(est.cfg, 2, 206, torch.bfloat16), estimator_inputs(est.cfg, 2, 250, torch.bfloat16)
    ext = {n: torch.tensor([2, n], device="cuda", dtype=torch.int32) for n in (206, 250)}
    cases = {"exact_206": lambda: fused(*live, True), "padded_250": lambda: fused(*cap, True),
             "ragged_206_of_250": lambda: fused(*cap, True, extent=ext[206]),
             "ragged_250_of_250": lambda: fused(*cap, True, extent=ext[250])}
    out = {}
    with torch.inference_mode():
        for name, fn in cases.items():
            out[name] = graph_profile(fn, iters=40, top=8)
            print(name, out[name]["ms"], out[name]["kernel_us_total"], flush=True)
    return out


def main() -> int:
    out, only = step_args("errors,timing")
    runner = gpu_runner("ragged_check.py", out, step_timeout=240)
    if "profile" in only:
        runner.run("profile", step_profile)
    if "errors" in only:
        runner.run("errors", step_errors)
    if "timing" in only:
        runner.run("timing", step_timing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
