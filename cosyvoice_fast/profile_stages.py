"""GPU profile behind BENCHMARKS.md: where a decode step and a flow chunk spend their time.

    python -m cosyvoice_fast.profile_stages [--synthetic full] [--dtype bf16] [--tokens 1075]

(1) times the ``cudagraph`` LLM alone (prefill + first token, then ms per decode step), (2) profiles 20 decode
steps with ``torch.profiler`` (GPU time per token and the top kernels), (3) times every flow chunk of one long
streamed utterance (prompt 75 tokens, default schedule) for the eager and cudagraph flows, each recomputing and
incremental, second pass reported (the first one captures graphs).  Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from .bench import synthetic_inputs
    from .cli_args import add_cli_args, from_cli_args
    from .config import BackendConfig, StreamParams
    from .runtime.state import SegmentState
    from .schedule import plan
    from .service import load_service

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.profile_stages")
    add_cli_args(ap, parts=("model", "device"), synthetic_default="full")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--tokens", type=int, default=1075, help="generated tokens of the long utterance")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_stages needs a CUDA GPU")
    run = from_cli_args(a, ap)
    if run.device.type != "cuda":
        raise SystemExit(f"profile_stages needs a CUDA GPU (--device {a.device} is not one)")
    a.dtype = run.dtype
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    try:
        inp = synthetic_inputs(svc.models.config, a.prompt_tokens, 30, 0).to("cuda", getattr(torch, {
            "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[a.dtype]))
        llm = svc.engine.stages(BackendConfig(llm="cudagraph", dtype=a.dtype)).llm

        def generate(n: int) -> tuple[float, float, int]:
            g = torch.Generator(device="cuda").manual_seed(0)
            it = llm.generate(inp, inp.text_segments[0], g, n, True)
            t = time.perf_counter()
            next(it)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            k = 1 + sum(1 for _ in it)
            return (t1 - t) * 1e3, (time.perf_counter() - t1) * 1e3 / (k - 1), k

        for _ in range(2):
            generate(50)
        first, per_token, k = generate(200)
        print(f"cudagraph LLM alone: prefill + first token {first:.1f} ms, decode {per_token:.3f} ms/token "
              f"over {k} tokens", flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        it = llm.generate(inp, inp.text_segments[0], g, 60, True)
        for _ in range(11):
            next(it)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                next(it)
            torch.cuda.synchronize()
        it.close()
        gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
        print(f"20 decode steps: {gpu_us / 1e3:.1f} ms of GPU time = {gpu_us / 20e3:.2f} ms per token")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))

        calls = plan(a.prompt_tokens, a.tokens, StreamParams())
        tokens = torch.randint(0, min(svc.models.config.flow.vocab_size, 4000), (1, a.tokens), dtype=torch.int32)
        for name, cfg in (("eager", BackendConfig(incremental=False, dtype=a.dtype)),
                          ("incremental", BackendConfig(flow="incremental", dtype=a.dtype)),
                          ("cudagraph", BackendConfig(flow="cudagraph", incremental=False, dtype=a.dtype)),
                          ("cudagraph-incremental", BackendConfig(flow="cudagraph", dtype=a.dtype))):
            flow = svc.engine.stages(cfg).flow
            for _ in range(2):  # the first pass captures graphs; the second is reported
                seg = SegmentState(index=0, text=inp.text_segments[0], cursor=None)
                times = []
                for c in calls:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    flow.chunk(seg, inp, tokens[:, :c.n_tokens], c)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t) * 1e3)
                seg.close()
            print(f"flow {name}: ms per chunk " + " ".join(f"{x:.0f}" for x in times), flush=True)
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
