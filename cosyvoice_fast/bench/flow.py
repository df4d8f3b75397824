"""Flow cost per streaming chunk: upstream's full recompute against the incremental flow (GPU benchmark).

    python -m cosyvoice_fast.bench.flow --synthetic full --dtype bf16 --out bench_flow_out

For one long utterance (prompt ``--prompt-tokens``, ``--tokens`` generated tokens) it times every flow call of
two schedules — upstream's default (hops 25, 50, 100, ...) and a constant hop of 25 tokens (``--chunks``
chunks, where each chunk does the same new work) — for three runners of the ``cudagraph`` flow:

* ``recompute``: every chunk re-runs encoder and solve over prompt + all tokens (upstream's scheme);
* ``incremental-cold``: incremental, the prompt's state computed by the request's first chunk;
* ``incremental-cached``: incremental, the voice's prompt state already cached (the speaker cache case).

Each runner is warmed up (graph captures) with two passes, then ``--reps`` timed passes; per chunk index the
median and p95 of the wall time (``torch.cuda.synchronize`` around each call) are reported, plus the time
inside the incremental estimator solve.  Final chunks run upstream's full-attention pass in every runner (the
default; see ``IncrementalFlow``).  Writes ``results.json`` and prints markdown tables.  Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class _TimedDecoder:
    """Wraps a runner's estimator solve to time it (synchronising around each call)."""

    def __init__(self, inner: Any):
        self.inner, self.times = inner, []
        self.save = getattr(inner, "save", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        torch.cuda.synchronize()
        self.times.append((time.perf_counter() - t) * 1e3)
        return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    from cosyvoice_fast.bench.engine_bench import synthetic_inputs
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args
    from cosyvoice_fast.config.backends import BackendConfig
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.engine.state import SegmentState
    from cosyvoice_fast.config.schedule import plan
    from cosyvoice_fast.serving.service import load_service

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.flow")
    add_cli_args(ap, parts=("model", "device"), synthetic_default="full")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--tokens", type=int, default=1075, help="generated tokens (default schedule)")
    ap.add_argument("--chunks", type=int, default=20, help="chunks of the constant-hop schedule")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_flow_out")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_flow needs a CUDA GPU")
    run = from_cli_args(a, ap)
    if run.device.type != "cuda":
        raise SystemExit(f"bench_flow needs a CUDA GPU (--device {a.device} is not one)")
    a.dtype = run.dtype
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    dtype = BackendConfig(dtype=a.dtype).torch_dtype
    schedules = {
        "default": (StreamParams(), a.tokens),
        "constant25": (StreamParams(token_hop_len=25, stream_scale_factor=1.0, token_max_hop_len=25),
                       25 * (a.chunks + 1)),
    }
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": a.dtype,
                               "prompt_tokens": a.prompt_tokens, "reps": a.reps, "runs": {}}
    try:
        base = synthetic_inputs(svc.models.config, a.prompt_tokens, 30, 0).to("cuda", dtype)
        rec = svc.engine.stages(BackendConfig(flow="cudagraph", incremental=False, dtype=a.dtype)).flow
        inc_stage = svc.engine.stages(BackendConfig(flow="cudagraph", incremental=True, dtype=a.dtype)).flow
        inc = inc_stage.incremental
        timed = _TimedDecoder(inc.decoder)
        inc.decoder = timed
        vocab = min(svc.models.config.flow.vocab_size, 4000)
        for sname, (params, n_tokens) in schedules.items():
            calls = plan(a.prompt_tokens, n_tokens, params)
            tokens = torch.randint(0, vocab, (1, n_tokens), dtype=torch.int32,
                                   generator=torch.Generator().manual_seed(1))
            runners = {"recompute": rec, "incremental-cold": inc_stage, "incremental-cached": inc_stage}
            for rname, stage in runners.items():
                per_chunk: list[list[float]] = [[] for _ in calls]
                solve: list[list[float]] = [[] for _ in calls]
                state_bytes = 0
                for rep in range(2 + a.reps):
                    if rname == "incremental-cold":
                        inc.prompt_states.clear()  # the first chunk computes the prompt's state
                    seg = SegmentState(index=0, text=base.text_segments[0], cursor=None)
                    for i, c in enumerate(calls):
                        timed.times.clear()
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        stage.chunk(seg, base, tokens[:, :c.n_tokens], c)
                        torch.cuda.synchronize()
                        if rep >= 2:
                            per_chunk[i].append((time.perf_counter() - t) * 1e3)
                            solve[i].append(sum(timed.times))
                        if i == len(calls) - 2 and hasattr(seg.flow_state, "nbytes"):
                            state_bytes = seg.flow_state.nbytes()
                    seg.close()
                rows = [{"chunk": i + 1, "new_tokens": c.hop, "final": c.finalize, "p50_ms": _pct(x, 50),
                         "p95_ms": _pct(x, 95), "solve_p50_ms": _pct(s, 50) if rname != "recompute" else None}
                        for i, (c, x, s) in enumerate(zip(calls, per_chunk, solve))]
                results["runs"][f"{sname}/{rname}"] = {"chunks": rows, "state_bytes_before_final": state_bytes}
                print(f"{sname:10s} {rname:18s} " + " ".join(f"{r['p50_ms']:.1f}" for r in rows), flush=True)
        results["incremental"] = {**inc.memory(), "captures": inc.graphs.captures, "replays": inc.graphs.replays,
                                  "saves": inc.graphs.saves, "loads": inc.graphs.loads,
                                  "prompt_hits": inc.prompt_hits, "prompt_misses": inc.prompt_misses}
        results["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    finally:
        svc.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(summary(results))
    return 0


def summary(results: dict[str, Any]) -> str:
    """Markdown: per-chunk p50 per runner, the first-chunk ratio and the flatness of the non-final chunks."""
    lines = []
    for sname in ("default", "constant25"):
        runs = {k.split("/")[1]: v for k, v in results["runs"].items() if k.startswith(sname + "/")}
        if not runs:
            continue
        n = len(next(iter(runs.values()))["chunks"])
        lines.append(f"\n{sname}: flow ms per chunk, p50 (p95) over {results['reps']} passes\n")
        lines.append("| runner | " + " | ".join(str(i + 1) for i in range(n)) + " |")
        lines.append("|---|" + "---:|" * n)
        for rname, r in runs.items():
            cells = [f"{c['p50_ms']:.1f} ({c['p95_ms']:.1f})" + (" F" if c["final"] else "") for c in r["chunks"]]
            lines.append(f"| {rname} | " + " | ".join(cells) + " |")
        rec, cached = runs.get("recompute"), runs.get("incremental-cached")
        if rec and cached:
            ratio = cached["chunks"][0]["p50_ms"] / rec["chunks"][0]["p50_ms"]
            body = [c["p50_ms"] for c in cached["chunks"] if not c["final"]]
            lines.append(f"\nfirst chunk cached/recompute = {ratio:.2f}; incremental-cached non-final chunks "
                         f"{min(body):.1f}-{max(body):.1f} ms (max/min {max(body) / min(body):.2f}); "
                         f"state before the final chunk {cached['state_bytes_before_final'] / 2 ** 20:.0f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
