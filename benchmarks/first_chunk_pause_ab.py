"""Same-process A/B of the LM pausing on its own ready first chunk (``Scheduler._yields``, ``LLMState.no_ahead``).

    PYTHONUNBUFFERED=1 python benchmarks/first_chunk_pause_ab.py --out $OUT --rounds 3 --requests 32 -- \
        --synthetic full --backends fused --dtype bf16

One service, the bench's concurrency-1 workload (``bench.bench_config``: a warm-up wave, then ``--requests``
requests one after another), alternating two scheduler rules per round:

- ``before``: the rule until session 26. An LM paused only while the chunk side was solving someone's first
  chunk, and its step after the one completing its first chunk was launched ahead as usual. So between its
  first chunk becoming ready and the chunk side taking it, the LM kept decoding: its decode turns held the GIL and
  its steps the GPU (the LLM stream has the higher priority) while the flow started.
- ``after``: the shipped rule. The LM pauses as soon as its own first chunk is ready, and that step launches
  nothing ahead.

Results: ``OUT/first_chunk_pause_ab.json`` (per round and variant the bench's aggregate: TTFB p50/p95 and its
stages).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def before_yields(self: Any, st: Any) -> bool:
    """The rule before session 26 (for the A/B only)."""
    if not self.first_busy or not self.config.first_chunk_priority:
        return False
    seg = st.segment
    return st.chunks_emitted > 0 or bool(seg is not None and seg.pending) or id(st) in self.busy


def main(argv: list[str]) -> None:
    from benchmarks import one_stream

    def flags(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--rounds", type=int, default=3)
        ap.add_argument("--requests", type=int, default=32)

    mine, bench_argv, out = one_stream.script_args(argv, __doc__, "benchmarks/first_chunk_pause_ab.py", flags)

    import torch

    from cosyvoice_fast import bench
    from cosyvoice_fast.runtime.scheduler import Scheduler

    one = one_stream.load(bench_argv, "benchmarks/first_chunk_pause_ab.py")
    svc, a, backend = one.svc, one.args, one.backend
    shipped = (Scheduler._yields, Scheduler._completes_first_chunk)
    variants = {"before": (before_yields, lambda self, st: False), "after": shipped}
    dev = svc.models.device
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "args": argv, "rounds": []}
    try:
        for r in range(mine.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            row: dict[str, Any] = {}
            for name in order:
                Scheduler._yields, Scheduler._completes_first_chunk = variants[name]
                agg = bench.bench_config(svc.engine, backend, 1, mine.requests, a)
                row[name] = {k: v for k, v in agg.items() if k.startswith("ttfb") or k in (
                    "llm_ms_per_token", "audio_s_per_s", "underruns", "n", "queue_chunk_ms")}
                print(f"round {r} {name}: TTFB p50 {agg['ttfb_ms']['p50']:.2f} p95 {agg['ttfb_ms']['p95']:.2f}; "
                      + ", ".join(f"{k[5:-3]} {v['p50']:.2f}" for k, v in agg.items()
                                  if k.startswith("ttfb.") and isinstance(v, dict)), flush=True)
            results["rounds"].append(row)
            (out / "first_chunk_pause_ab.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        Scheduler._yields, Scheduler._completes_first_chunk = shipped
        svc.close()
    for name in variants:
        p50 = [row[name]["ttfb_ms"]["p50"] for row in results["rounds"]]
        results[f"{name}_ttfb_p50_median"] = statistics.median(p50)
        print(f"{name}: TTFB p50 per round {', '.join(f'{x:.2f}' for x in p50)}")
    (out / "first_chunk_pause_ab.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
