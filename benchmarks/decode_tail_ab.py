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

``--variants before,floor`` (the default) names the variants built beside ``after``.

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


VARIANTS = {"before": {"floor": False, "gemv_head": False}, "floor": {"floor": True}}


def build_llm(stages: Any, one: Any, floor: bool = False, **tiles_change: Any) -> Any:
    """A ``fused`` LLM stage like the service's, captured with the floor as asked and ``qwen2_proj.TILES``
    changed by ``tiles_change``."""
    from cosyvoice_fast.engine.stages import _build_llm
    from cosyvoice_fast.llm.kernels import nucleus_topk, qwen2_proj

    config = one.backend
    tiles, use_floor = qwen2_proj.TILES, nucleus_topk.USE_FLOOR
    qwen2_proj.TILES, nucleus_topk.USE_FLOOR = dataclasses.replace(tiles, **tiles_change), floor
    try:
        return _build_llm(stages.models, config.llm, stages._cast("llm", config.torch_dtype), config.torch_dtype,
                          stages.engine_config)
    finally:
        qwen2_proj.TILES, nucleus_topk.USE_FLOOR = tiles, use_floor


def _add_variants(ap: Any) -> None:
    ap.add_argument("--variants", default="before,floor", help=f"built beside 'after', from {sorted(VARIANTS)}")


def main(argv: list[str]) -> None:
    from benchmarks import one_stream

    mine, out, one, stages, shipped = one_stream.stage_ab(argv, __doc__, "benchmarks/decode_tail_ab.py", "llm",
                                                          "fused", _add_variants)
    names = [v for v in mine.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"decode_tail_ab.py: unknown variants {bad}; choose from {sorted(VARIANTS)}")
    llms = {name: build_llm(stages, one, **VARIANTS[name]) for name in names}
    llms["after"] = shipped.llm
    one_stream.swap_rounds(one, shipped, "llm", llms, mine.rounds, mine.requests, out / "decode_tail_ab.json", argv)


if __name__ == "__main__":
    main(sys.argv[1:])
