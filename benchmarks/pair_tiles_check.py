"""One GPU run: the CFG-pair tiles (``estimator_common.PAIR_ROWS``) against session 22's routing, whole forward.

    PYTHONUNBUFFERED=1 python benchmarks/pair_tiles_check.py --out $OUT/pair_tiles_check.json

Full-size estimator, bf16, seeded random weights, chunk attention, the time-table row given (as the engine's
step graphs run it).  Modes, switched in one process:

* ``session22``: the routing before the pair tiles -- one-shot GEMMs only up to 300 rows with their old tiles,
  the shared attention and convolution tiles at every row count;
* ``pair``: the shipped defaults;
* ``pair_all``: the pair tiles from one row on (no lower bound).

Step ``forward``: median ms of 50 graph replays per (mode, shape), three alternating rounds, and each mode's
largest output difference from ``session22`` (bf16 rounding in another order).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import alternating_rounds, gpu_runner, step_args  # noqa: E402

SHAPES = ((2, 56), (2, 100), (2, 150), (2, 200), (2, 250), (2, 300), (4, 200))
MODES = ("session22", "pair", "pair_all")


def set_mode(mode: str) -> None:
    """Switch the estimator kernels' routing to ``mode`` (settings read at each launch)."""
    from cosyvoice_fast.kernels import common as estimator_common

    estimator_common.PAIR_ROWS.update(min=1 if mode == "pair_all" else 129, max=0 if mode == "session22" else 512)
    estimator_common.LAUNCH["oneshot_max_rows"] = 300 if mode == "session22" else 512


def main() -> int:
    out, steps = step_args("forward")
    runner = gpu_runner("pair_tiles_check.py", out, step_timeout=400)
    from benchmarks.first_forward_ab import full_fused_bf16, step_forward
    from cosyvoice_fast.bench.estimator_profile import graph_replay_ms

    fused = full_fused_bf16()
    calls = {shape: step_forward(fused, *shape) for shape in SHAPES}

    def call(shape: tuple[int, int]):  # noqa: ANN202
        return calls[shape]

    def timed(shape: tuple[int, int], mode: str) -> float:
        set_mode(mode)
        return graph_replay_ms(call(shape), iters=50)

    def forward() -> dict:
        r: dict = {"diff_vs_session22": {}}
        with torch.inference_mode():
            for shape in SHAPES:
                set_mode("session22")
                ref = call(shape)().float()
                for mode in MODES[1:]:
                    set_mode(mode)
                    d = (call(shape)().float() - ref).abs().max().item()
                    r["diff_vs_session22"][f"{shape[0]}x{shape[1]}_{mode}"] = round(d, 4)
            r.update(alternating_rounds({f"{s[0]}x{s[1]}": s for s in SHAPES}, MODES, timed))
        set_mode("pair")
        return r

    if "forward" in steps:
        runner.run("forward", forward)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
