"""Same-process A/B of a one-row decode step's ends: the step's own embedding gather and speech head, and the
nucleus draw cut at its floor (session 28).

    PYTHONUNBUFFERED=1 python benchmarks/decode_tail_ab.py --out $OUT --rounds 3 --requests 32 -- \\
        --synthetic full --backends fused --dtype bf16 --flow-rows 1 --vocoder-rows 1

One service, the bench's concurrency-1 workload, alternating per round (``one_stream.ab_rounds``) between LLM
stages built for the one stage set the requests run on (the flow and vocoder stages are shared):

- ``before``: the decode graphs as before session 28: the step's embedding gather, final norm and speech head
  are the torch ops around the fused layers (``Tiles.gemv_head`` off);
- ``floor``: the shipped step with the nucleus draw cut at its floor (``nucleus_topk.USE_FLOOR`` on; off by
  default);
- ``after``: the shipped code.

The switches are read while a stage captures its graphs, so each variant is its own ``FusedLLM``, built under
them at start-up.  Results: ``OUT/decode_tail_ab.json`` (per round and variant the bench's aggregate: TTFB
p50/p95, its stages and the LLM's ms per token).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_llm(stages: Any, one: Any, floor: bool, head: bool) -> Any:
    """A ``fused`` LLM stage like the service's, captured with the floor and the step's head as asked."""
    from cosyvoice_fast.backends import _build_llm
    from cosyvoice_fast.kernels import nucleus_topk, qwen2_proj

    config = one.backend
    tiles, use_floor = qwen2_proj.TILES, nucleus_topk.USE_FLOOR
    qwen2_proj.TILES, nucleus_topk.USE_FLOOR = dataclasses.replace(tiles, gemv_head=head), floor
    try:
        return _build_llm(stages.models, config.llm, stages._cast("llm", config.torch_dtype), config.torch_dtype,
                          stages.engine_config)
    finally:
        qwen2_proj.TILES, nucleus_topk.USE_FLOOR = tiles, use_floor


def main(argv: list[str]) -> None:
    from benchmarks import one_stream

    mine, out, one, stages, shipped = one_stream.stage_ab(argv, __doc__, "benchmarks/decode_tail_ab.py", "llm",
                                                          "fused")
    llms = {"before": build_llm(stages, one, floor=False, head=False),
            "floor": build_llm(stages, one, floor=True, head=True), "after": shipped.llm}
    one_stream.swap_rounds(one, shipped, "llm", llms, mine.rounds, mine.requests, out / "decode_tail_ab.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
