"""Where one request's first-chunk flow call goes on the GPU: encoder, the ten Euler steps, and the glue.

    PYTHONUNBUFFERED=1 python benchmarks/first_chunk_check.py --out $OUT/first_chunk_check.json

Full-size flow with random weights in bf16, the ``fused`` flow stage (recompute, as a new voice's first chunk
runs), the benchmark's workload: a 75-token prompt and the default schedule's first call (28 tokens, 25 + 3
look-ahead; 200 estimator frames).  Steps:

- ``split``: median GPU ms (CUDA events) and host ms (synchronised wall) of the whole call
  (:meth:`CudaGraphFlow.recompute`), of its encoder half, of its solve half (``flow.decode`` with the graph
  runner), of ten bare replays of the 2 x 200 step graph and of one; then the same with the step loop over
  single-forward graphs (``GraphEstimator.steps`` off), and the largest difference between the two mels;
- ``timeline``: ``torch.profiler`` over one whole call: kernels, their summed µs and the GPU span, split into
  the encoder part (before the first estimator kernel), the estimator replays, and what runs between them.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import gpu_runner, step_args  # noqa: E402

PROMPT_TOKENS = 75  # the issue-19 benchmark's prompt


def _median_ms(fn, iters: int) -> dict:  # noqa: ANN001
    """Median GPU (CUDA events) and host (synchronised wall) ms of ``fn()``."""
    gpu, host = [], []
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        b.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
        gpu.append(a.elapsed_time(b))
    return {"gpu_ms": round(statistics.median(gpu), 3), "host_ms": round(statistics.median(host), 3)}


def build(prompt_tokens: int, seed: int = 0):  # noqa: ANN201
    """(stage, flow, inputs, tokens, call) at full size, bf16, the fused flow stage."""
    from cosyvoice_fast.flow.fused import FusedFlow
    from cosyvoice_fast.config.model import StreamParams, full_config
    from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec
    from cosyvoice_fast.config.schedule import plan

    cfg = full_config()
    torch.manual_seed(seed)
    flow = CausalMaskedDiffWithXvec(cfg.flow).cuda().eval().to(torch.bfloat16).requires_grad_(False)
    stage = FusedFlow(flow, cfg, progress=False)
    g = torch.Generator().manual_seed(seed)
    inputs = SimpleNamespace(
        embedding=torch.randn(1, cfg.flow.spk_embed_dim, generator=g).cuda().to(torch.bfloat16),
        flow_prompt_speech_token=torch.randint(0, cfg.flow.vocab_size, (1, prompt_tokens), generator=g).cuda(),
        prompt_feat=torch.randn(1, cfg.flow.token_mel_ratio * prompt_tokens, 80, generator=g).cuda())
    call = plan(prompt_tokens, 150, StreamParams())[0]
    tokens = torch.randint(0, cfg.flow.vocab_size, (1, call.n_tokens), generator=g)
    return stage, flow, inputs, tokens, call


def main() -> int:
    out, steps = step_args("split,timeline")
    runner = gpu_runner("first_chunk_check.py", out)
    from benchmarks.serve_profile import kernel_stages
    from cosyvoice_fast.flow.eager import _encode_call

    iters = 30
    stage, flow, inputs, tokens, call = build(PROMPT_TOKENS)
    runner.results.update(prompt_tokens=PROMPT_TOKENS, call=str(call))

    def whole() -> torch.Tensor:
        return stage.recompute(inputs, tokens, call, True)

    def encode():  # noqa: ANN202
        with torch.inference_mode():
            return _encode_call(flow, inputs, tokens, call, True, stage.encoder)

    def split() -> dict:
        with torch.inference_mode():
            mel = whole()
            enc = encode()
            frames = enc.mu.shape[2]
            key = (stage.estimator.bucket(frames), 2, enc.mu.dtype)
            graph = stage.estimator.steps.caches[True].graphs[key].graph

            def solve() -> torch.Tensor:
                return flow.decode(enc.mu, enc.spks, inputs.prompt_feat, streaming=True, estimator=stage.estimator)

            def replays(n: int):  # noqa: ANN202
                def go() -> None:
                    for _ in range(n):
                        graph.replay()
                return go

            r = {"frames": frames, "bucket": key[0], "mel_frames": mel.shape[2],
                 "whole": _median_ms(whole, iters), "encode": _median_ms(encode, iters),
                 "solve": _median_ms(solve, iters), "step_replay_x10": _median_ms(replays(10), iters),
                 "step_replay_x1": _median_ms(replays(1), iters)}
            # the same call with the step loop over single-forward graphs (graph_solve off)
            steps, stage.estimator.steps = stage.estimator.steps, None
            try:
                loop_mel = whole()
                graph = stage.estimator.caches[True].graphs[key].graph
                r["loop"] = {"whole": _median_ms(whole, iters), "solve": _median_ms(solve, iters),
                             "forward_replay_x10": _median_ms(replays(10), iters),
                             "forward_replay_x1": _median_ms(replays(1), iters)}
            finally:
                stage.estimator.steps = steps
            r["step_vs_loop_max_abs"] = (whole() - loop_mel).abs().max().item()
            return r

    def timeline() -> dict:
        from torch.profiler import ProfilerActivity, profile

        est_names = {k for k, s in kernel_stages().items() if s == "flow estimator"}
        with torch.inference_mode():
            whole()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                whole()
                torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        t0 = evs[0].time_range.start
        rows = [(e.name.split("(")[0][:48], e.time_range.start - t0, e.time_range.end - e.time_range.start,
                 any(e.name.startswith(k) for k in est_names)) for e in evs]
        first = next(i for i, r in enumerate(rows) if r[3])
        last = max(i for i, r in enumerate(rows) if r[3])
        enc = rows[:first]
        glue = [r for r in rows[first:last + 1] if not r[3]]
        tail = rows[last + 1:]
        span = rows[-1][1] + rows[-1][2]

        def part(rs: list) -> dict:
            names: dict[str, float] = {}
            for r in rs:
                names[r[0]] = names.get(r[0], 0.0) + r[2]
            top = sorted(names.items(), key=lambda kv: -kv[1])[:10]
            return {"kernels": len(rs), "kernel_us": round(sum(r[2] for r in rs), 1),
                    "top_us": {k: round(v, 1) for k, v in top}}

        est = [r for r in rows if r[3]]
        return {"kernels": len(rows), "span_us": round(span, 1), "kernel_us": round(sum(r[2] for r in rows), 1),
                "encoder_part": {**part(enc), "span_us": round(rows[first][1], 1)},
                "estimator": {"kernels": len(est), "kernel_us": round(sum(r[2] for r in est), 1),
                              "span_us": round(rows[last][1] + rows[last][2] - rows[first][1], 1)},
                "between_replays": part(glue), "after": part(tail),
                "glue_sequence_first_step": [r[:3] for r in rows[first:last + 1] if not r[3]][:40]}

    for name, fn in (("split", split), ("timeline", timeline)):
        if name in steps:
            runner.run(name, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
