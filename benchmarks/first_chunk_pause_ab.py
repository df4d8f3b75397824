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

    mine, bench_argv, out = one_stream.script_args(argv, __doc__, "benchmarks/first_chunk_pause_ab.py",
                                                   one_stream.ab_flags)

    from cosyvoice_fast.engine.scheduler import Scheduler

    one = one_stream.load(bench_argv, "benchmarks/first_chunk_pause_ab.py")
    shipped = (Scheduler._yields, Scheduler._completes_first_chunk)

    def use(rule: tuple[Any, Any]) -> Any:
        def apply() -> None:
            Scheduler._yields, Scheduler._completes_first_chunk = rule
        return apply

    one_stream.ab_rounds(one, {"before": use((before_yields, lambda self, st: False)), "after": use(shipped)},
                         mine.rounds, mine.requests, out / "first_chunk_pause_ab.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
