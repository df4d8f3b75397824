"""Bi-streaming benchmark: text arriving at an LLM's pace, audio streaming out, at several concurrencies.

    python -m cosyvoice_fast.bench.bistream --synthetic full --device cuda --backend cudagraph --concurrency 1,16

Each request's text (random token ids: no tokenizer needed, so it runs on a GPU box without one) arrives in
pieces of ``--piece-tokens`` ids every ``--piece-interval-ms`` (default 5 per 100 ms).  Reported per concurrency
(median and p95 over the requests): first audio measured from the first text piece and from the 5th text token,
and the lag of the last audio chunk behind the last text piece.  The LM runs to ``--gen-tokens`` (random weights
never pick eos), so runs are comparable.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cosyvoice_fast.bench.engine_bench import run_wave, synthetic_inputs
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.frontend.request import SynthesisRequest
from cosyvoice_fast.telemetry.record import RequestTelemetry

log = logging.getLogger(__name__)


def paced(ids: list[int], piece: int, interval_s: float) -> Iterator[list[int]]:
    """``ids`` in pieces of ``piece``, one every ``interval_s`` (the first at once)."""
    for i in range(0, len(ids), piece):
        if i:
            time.sleep(interval_s)
        yield ids[i:i + piece]


def summarise(teles: list[RequestTelemetry]) -> dict[str, float]:
    """Median and p95 (ms) of the bi-streaming figures over ``teles``."""
    out: dict[str, float] = {"requests": len(teles)}
    for name in ("first_audio_from_text", "first_audio_from_token5", "last_audio_lag", "ttfb"):
        vals = np.array([getattr(t, name) * 1e3 for t in teles], dtype=float)
        vals = vals[np.isfinite(vals)]
        out[f"{name}_p50_ms"] = float(np.median(vals)) if vals.size else math.nan
        out[f"{name}_p95_ms"] = float(np.percentile(vals, 95)) if vals.size else math.nan
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args
    from cosyvoice_fast.serving.service import load_service

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.bistream", description=__doc__.split("\n")[0])
    add_cli_args(ap, parts=("model", "device", "engine"))
    ap.add_argument("--backend", default="eager", help="LLM backend: eager, or cudagraph (the graph runner)")
    ap.add_argument("--flow-backend", default=None, help="flow/vocoder backend (default: the LLM's)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=None, help="per concurrency (default: max(20, c))")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--text-tokens", type=int, default=60)
    ap.add_argument("--gen-tokens", type=int, default=150)
    ap.add_argument("--piece-tokens", type=int, default=5)
    ap.add_argument("--piece-interval-ms", type=float, default=100.0)
    ap.add_argument("--out", default="bench_bistream_out")
    a = ap.parse_args(argv)
    run = from_cli_args(a, ap)
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    other = a.flow_backend or a.backend
    backend = BackendConfig(llm=a.backend, flow=other, vocoder=other, dtype=run.dtype)
    cfg = svc.models.config
    results: dict[str, Any] = {"device": str(svc.models.device), "dtype": run.dtype, "backend": a.backend,
                               "flow_backend": other, "args": vars(a), "by_concurrency": {}}
    try:
        def make(i: int) -> SynthesisRequest:
            inputs = synthetic_inputs(cfg, a.prompt_tokens, a.text_tokens, seed=i)
            ids = inputs.text_segments[0][0].tolist()
            return SynthesisRequest(inputs=inputs, text_source=paced(ids, a.piece_tokens, a.piece_interval_ms / 1e3),
                                    seed=i, backend=backend, max_tokens=a.gen_tokens)

        run_wave(svc.engine, [make(10_000)])  # warm-up: graphs, allocator
        for c in [int(x) for x in a.concurrency.split(",")]:
            n = a.requests or max(20, c)
            teles: list[RequestTelemetry] = []
            for start in range(0, n, c):
                teles += run_wave(svc.engine, [make(start + j) for j in range(min(c, n - start))])
            agg = summarise(teles)
            results["by_concurrency"][str(c)] = agg
            print(f"c={c:3d} n={n}: first audio from first text piece p50 {agg['first_audio_from_text_p50_ms']:.1f} "
                  f"ms (p95 {agg['first_audio_from_text_p95_ms']:.1f}), from 5th text token p50 "
                  f"{agg['first_audio_from_token5_p50_ms']:.1f} ms, last-audio lag p50 "
                  f"{agg['last_audio_lag_p50_ms']:.1f} ms (p95 {agg['last_audio_lag_p95_ms']:.1f})")
    finally:
        svc.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
