"""Same-process A/B of the fused vocoder's convolutions: cuDNN's against the Triton kernels (session 29).

    PYTHONUNBUFFERED=1 python benchmarks/vocoder_ab.py --out $OUT --rounds 3 --requests 32 -- \\
        --synthetic full --backends fused --dtype bf16 --flow-rows 1 --vocoder-rows 1

One service, the bench's concurrency-1 workload, alternating per round (``one_stream.ab_rounds``) between
vocoder stages built like the service's for the one stage set the requests run on (LLM and flow shared):

- ``cudnn``: the fused vocoder as before session 29 (captured with ``hift_conv.LAUNCH["max_rows"]`` at 0: no
  call takes the Triton convolutions);
- ``triton``: the shipped stage (its one-row calls on :mod:`cosyvoice_fast.vocoder.kernels.hift_conv`).

Results: ``OUT/vocoder_ab.json`` (per round and variant the bench's aggregate: TTFB p50/p95 and its stages).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_cudnn_vocoder(stages: Any) -> Any:
    """A ``fused`` vocoder stage like the service's (same captured lengths and rows), captured with
    ``hift_conv.LAUNCH["max_rows"]`` at 0, so no call runs the Triton convolutions."""
    from cosyvoice_fast.engine.stages import _build_vocoder
    from cosyvoice_fast.vocoder.kernels import hift_conv

    saved = hift_conv.LAUNCH["max_rows"]
    hift_conv.LAUNCH["max_rows"] = 0
    try:
        return _build_vocoder(stages.models, "fused", stages.engine_config)
    finally:
        hift_conv.LAUNCH["max_rows"] = saved


def main(argv: list[str]) -> None:
    from benchmarks import one_stream

    mine, out, one, stages, shipped = one_stream.stage_ab(argv, __doc__, "benchmarks/vocoder_ab.py", "vocoder",
                                                          "fused")
    vocoders = {"cudnn": build_cudnn_vocoder(stages), "triton": shipped.vocoder}
    one_stream.swap_rounds(one, shipped, "vocoder", vocoders, mine.rounds, mine.requests, out / "vocoder_ab.json",
                           argv)


if __name__ == "__main__":
    main(sys.argv[1:])
