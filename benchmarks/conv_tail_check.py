"""One GPU run: ResNet convs as tail convs (their LayerNorm pass in the conv's last programs) against conv + row pass.

    PYTHONUNBUFFERED=1 python benchmarks/conv_tail_check.py --out $OUT/conv_tail_check.json

Full-size estimator, bf16, seeded random weights, chunk attention, the time-table row given (as the engine's
step graphs run it).  ``estimator_common.LAUNCH["conv_tail"]`` switches the two modes (``rowpass``: the
separate row passes, the default; ``tail`` and two tile variants of it, :data:`VARIANTS`), read at each
capture.  Steps:

- ``forward``: each mode's kernels per forward at 2 x 200 and largest output difference from ``rowpass``, then
  the median ms of 50 graph replays per (mode, shape), three alternating rounds;
- ``chunk``: a new voice's first-chunk flow call (:func:`benchmarks.first_chunk_check.build`: a 75-token
  prompt, 28 tokens, 200 estimator frames), one ``fused`` flow stage per mode with its graphs captured under
  that mode; median GPU and host ms of the whole call, three alternating rounds of 30 calls, and the largest
  difference between the two mels.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import alternating_rounds, gpu_runner, step_args  # noqa: E402

SHAPES = ((2, 56), (2, 100), (2, 200), (2, 250), (4, 200))
#: mode -> (tail convs on, the pair-row conv tiles' overrides): ``tail_bn64`` keeps 64-wide column tiles (4 per
#: row tile, 100 programs at 2 x 200) where the default spreads them to 32 (8 per row tile), ``tail_bm32`` takes
#: 32-row tiles (half the row tiles, so half the last-program passes)
VARIANTS = {"rowpass": (False, {}), "tail": (True, {}), "tail_bn64": (True, {"min_programs": 0}),
            "tail_bm32": (True, {"bm": 32, "bn": 32})}
MODES = tuple(VARIANTS)
_PAIR0: dict = {}


def set_mode(mode: str) -> None:
    """Switch the ResNet convs to ``mode`` (read at each launch, so at each capture)."""
    from cosyvoice_fast.kernels import common as estimator_common
    from cosyvoice_fast.flow.kernels import estimator_conv

    tail, tiles = VARIANTS[mode]
    _PAIR0 or _PAIR0.update(estimator_conv.TUNING_PAIR)
    estimator_conv.TUNING_PAIR.clear()
    estimator_conv.TUNING_PAIR.update({**_PAIR0, **tiles})
    estimator_common.LAUNCH["conv_tail"] = tail


def main() -> int:
    out, steps = step_args("forward,chunk")
    runner = gpu_runner("conv_tail_check.py", out, step_timeout=300)

    def forward() -> dict:
        from benchmarks.first_forward_ab import full_fused_bf16, step_forward
        from cosyvoice_fast.bench.estimator_profile import count_kernels, graph_replay_ms

        fused = full_fused_bf16()
        calls = {shape: step_forward(fused, *shape) for shape in SHAPES}
        r: dict = {"kernels_2x200": {}, "diff_vs_rowpass": {}}

        def timed(shape: tuple[int, int], mode: str) -> float:
            set_mode(mode)
            return graph_replay_ms(calls[shape], iters=50)

        with torch.inference_mode():
            for mode in MODES:
                set_mode(mode)
                calls[(2, 200)]()
                r["kernels_2x200"][mode] = count_kernels(calls[(2, 200)])
            for shape in SHAPES:
                set_mode("rowpass")
                ref = calls[shape]().float()
                for mode in MODES[1:]:
                    set_mode(mode)
                    d = (calls[shape]().float() - ref).abs().max().item()
                    r["diff_vs_rowpass"][f"{shape[0]}x{shape[1]}_{mode}"] = round(d, 4)
            r.update(alternating_rounds({f"{s[0]}x{s[1]}": s for s in SHAPES}, MODES, timed))
        set_mode("rowpass")
        return r

    def chunk() -> dict:
        from benchmarks.first_chunk_check import PROMPT_TOKENS, _median_ms, build

        stages, mels = {}, {}
        with torch.inference_mode():
            for mode in ("rowpass", "tail"):
                set_mode(mode)
                stage, _, inputs, tokens, call = build(PROMPT_TOKENS)
                stages[mode] = (stage, inputs, tokens, call)
                mels[mode] = stage.recompute(inputs, tokens, call, True)  # captures this mode's graphs
            r: dict = {"mel_diff": round((mels["tail"] - mels["rowpass"]).abs().max().item(), 4), "runs": {}}
            for _ in range(3):
                for mode in stages:
                    stage, inputs, tokens, call = stages[mode]
                    res = _median_ms(lambda: stage.recompute(inputs, tokens, call, True), 30)  # noqa: B023
                    r["runs"].setdefault(mode, []).append(res)
        set_mode("rowpass")
        r["median"] = {m: {k: round(statistics.median(x[k] for x in v), 3) for k in ("gpu_ms", "host_ms")}
                       for m, v in r["runs"].items()}
        return r

    for name, fn in (("forward", forward), ("chunk", chunk)):
        if name in steps:
            runner.run(name, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
