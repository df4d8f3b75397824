"""GPU profile behind docs/RESULTS.md: where a decode step, an estimator forward and a flow chunk spend their time.

    python -m cosyvoice_fast.bench.profile_stages [--synthetic full] [--dtype bf16] [--tokens 1075]
        [--llm-backends cudagraph,fused] [--frames 56,200,206] [--flows ...] [--skip-flow] [--out F.json]

For each LLM backend (``cudagraph`` and ``fused`` side by side): (1) times it alone (prefill + first token, then
ms per decode step), (2) profiles 20 decode steps with ``torch.profiler`` (kernels per step, GPU time per token,
the top kernels); then (2b) the decoder math of one step as each backend's graph runs it, at 1 and 16 rows,
against the H100's memory bandwidth (:mod:`.profile_llm`); (3) one estimator forward of a CFG pair at each of
``--frames``, ``cudagraph`` (the eager estimator captured) against ``fused`` (as the step graphs run it, with
its time-table row): kernels, graph-replay ms and TFLOP/s against the H100's dense bf16 peak
(:mod:`.kernels.estimator_profile`); (4) times every flow chunk of one long streamed utterance (prompt 75
tokens, default schedule) for each of ``--flows``, second pass reported (the first one captures graphs).
``--out`` writes every number as JSON, rewritten after each part so a cut-off run keeps what it measured.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from cosyvoice_fast.bench.profile_llm import H100_GBS, step_profile

#: flow variants of part (4): name -> BackendConfig fields (each recomputing, then incremental)
FLOWS = {"eager": {"flow": "eager", "incremental": False}, "incremental": {"flow": "eager"},
         "cudagraph": {"flow": "cudagraph", "incremental": False}, "cudagraph-incremental": {"flow": "cudagraph"},
         "fused": {"flow": "fused", "incremental": False}, "fused-incremental": {"flow": "fused"}}


def profile_llm_backend(llm: object, name: str, inp: object) -> dict:
    """Prefill + first token and ms per decode step of one LLM stage alone, then 20 profiled decode steps:
    kernels per step, GPU time per token and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from cosyvoice_fast.bench.llm_tools import iter_alone

    def generate(n: int) -> tuple[float, float, int]:
        g = torch.Generator(device="cuda").manual_seed(0)
        it = iter_alone(llm, inp, inp.text_segments[0], g, n, True)  # type: ignore[arg-type]
        t = time.perf_counter()
        next(it)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        k = 1 + sum(1 for _ in it)
        return (t1 - t) * 1e3, (time.perf_counter() - t1) * 1e3 / (k - 1), k

    for _ in range(2):
        generate(50)
    first, per_token, k = generate(200)
    print(f"{name} LLM alone: prefill + first token {first:.1f} ms, decode {per_token:.3f} ms/token over {k} tokens",
          flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    it = iter_alone(llm, inp, inp.text_segments[0], g, 60, True)  # type: ignore[arg-type]
    for _ in range(11):
        next(it)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            next(it)
        torch.cuda.synchronize()
    it.close()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
    print(f"{name}: 20 decode steps: {len(kernels) / 20:.0f} kernels per step, {gpu_us / 1e3:.1f} ms of GPU time = "
          f"{gpu_us / 20e3:.3f} ms per token")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    return {"prefill_first_token_ms": round(first, 3), "decode_ms_per_token": round(per_token, 4), "tokens": k,
            "kernels_per_step": round(len(kernels) / 20, 1), "gpu_ms_per_token": round(gpu_us / 20e3, 4)}


def flow_chunk_ms(flow: object, inp: object, tokens: torch.Tensor, calls: list) -> list[float]:
    """Wall ms of every chunk of one streamed utterance through ``flow`` (synchronised around each call), second
    of two passes: the first captures the graphs a chunk shape needs."""
    from cosyvoice_fast.engine.state import SegmentState

    times: list[float] = []
    for _ in range(2):
        seg = SegmentState(index=0, text=inp.text_segments[0], cursor=None)  # type: ignore[attr-defined]
        times = []
        for c in calls:
            torch.cuda.synchronize()
            t = time.perf_counter()
            flow.chunk(seg, inp, tokens[:, :c.n_tokens], c)  # type: ignore[attr-defined]
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        seg.close()
    return times


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated frame counts like 56,206, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"frame counts must be >= 1, got {text!r}")
    return out


def _names(text: str) -> tuple[str, ...]:
    out = tuple(text.split(","))
    bad = [n for n in out if n not in FLOWS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown flow {', '.join(bad)}; choose from {', '.join(FLOWS)}")
    return out


def main(argv: list[str] | None = None) -> int:
    from cosyvoice_fast.bench.engine_bench import synthetic_inputs
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args
    from cosyvoice_fast.config.backends import TORCH_DTYPES, BackendConfig
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.bench.estimator_profile import estimator_profile
    from cosyvoice_fast.config.schedule import plan
    from cosyvoice_fast.serving.service import load_service

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.profile_stages")
    add_cli_args(ap, parts=("model", "device"), synthetic_default="full")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--tokens", type=int, default=1075, help="generated tokens of the long utterance")
    ap.add_argument("--llm-backends", default="cudagraph,fused", help="LLM backends profiled side by side")
    ap.add_argument("--frames", type=_ints, default=(56, 200, 206),
                    help="estimator frame counts of part (3), one CFG pair each (200: a new voice's first chunk)")
    ap.add_argument("--flows", type=_names, default=tuple(FLOWS), help=f"flows of part (4): {','.join(FLOWS)}")
    ap.add_argument("--skip-flow", action="store_true", help="stop after the LLM profiles")
    ap.add_argument("--out", type=Path, help="write every number measured as JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_stages needs a CUDA GPU")
    run = from_cli_args(a, ap)
    if run.device.type != "cuda":
        raise SystemExit(f"profile_stages needs a CUDA GPU (--device {a.device} is not one)")
    a.dtype = run.dtype
    report: dict = {"gpu": torch.cuda.get_device_name(run.device), "torch": torch.__version__, "dtype": a.dtype,
                    "argv": argv, "llm": {}, "decode_math": [], "estimator": [], "flow_ms_per_chunk": {}}

    def save() -> None:
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(report, indent=1))

    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    try:
        dtype = TORCH_DTYPES[a.dtype]
        report["model"] = svc.model_name
        inp = synthetic_inputs(svc.models.config, a.prompt_tokens, 30, 0).to("cuda", dtype)
        for name in a.llm_backends.split(","):
            stage = svc.engine.stages(BackendConfig(llm=name, dtype=a.dtype)).llm
            report["llm"][name] = profile_llm_backend(stage, name, inp)
            save()
        # the decoder math alone, as each backend's decode graph runs it, against the bandwidth floor
        lm = svc.models.llm if svc.models.dtype == dtype else copy.deepcopy(svc.models.llm).to(dtype)
        print("decode-step math as CUDA graphs (context 300, KV bucket 512):")
        for rows in (1, 16):
            for name in a.llm_backends.split(","):
                p = step_profile(lm, name, rows, 300, 1024, 512)
                report["decode_math"].append(p.as_dict())
                print(f"  {name:9s} rows {rows:2d}: {p.kernels} kernels, {p.graph_ms:.3f} ms/step "
                      f"(kernels alone {p.kernel_ms:.3f}), {p.gbs:.0f} GB/s = {100 * p.peak_fraction:.0f}% of "
                      f"{H100_GBS / 1e3:.2f} TB/s", flush=True)
        save()
        if a.skip_flow:
            return 0
        flow_model = svc.models.flow if svc.models.dtype == dtype else copy.deepcopy(svc.models.flow).to(dtype)
        print("estimator forward of one CFG pair, chunk-causal attention, as CUDA graphs:")
        for e in estimator_profile(flow_model.decoder.estimator, frames=a.frames):
            report["estimator"].append(e.as_dict())
            print("  " + e.line(), flush=True)
        save()
        calls = plan(a.prompt_tokens, a.tokens, StreamParams())
        tokens = torch.randint(0, min(svc.models.config.flow.vocab_size, 4000), (1, a.tokens), dtype=torch.int32)
        for name in a.flows:
            flow = svc.engine.stages(BackendConfig(dtype=a.dtype, **FLOWS[name])).flow  # type: ignore[arg-type]
            times = flow_chunk_ms(flow, inp, tokens, calls)
            report["flow_ms_per_chunk"][name] = [round(x, 2) for x in times]
            print(f"flow {name}: first chunk {times[0]:.1f} ms; ms per chunk " + " ".join(f"{x:.0f}" for x in times),
                  flush=True)
            save()
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
