"""One GPU run: GEMM routing and tiles for the estimator forward of a first chunk (one CFG pair, 200 frames).

    PYTHONUNBUFFERED=1 python benchmarks/first_forward_ab.py --out $OUT/first_forward_ab.json

A new voice's first chunk on the benchmark workload is ten forwards of one CFG pair at 200 frames (400 rows),
which was above ``LAUNCH["oneshot_max_rows"]`` (300 before session 23), so its GEMMs ran row-tiled.  Session
15 timed one-shot GEMMs at 412 rows faster per GEMM kind but saw no gain in the whole forward at 200 frames (on
an H200).  This script times the whole forward as the engine replays it (a CUDA graph, chunk attention, the
time-table row given) under GEMM routings that differ per kind (q/k/v, out-projection, FF1, FF2), with one-shot
tile variants per kind:

1. ``sweep``: every routing of :func:`configs` at 2 x 200, three alternating rounds (medians of 50 replays);
   each output's largest difference from the row-tiled one;
2. ``greedy``: per kind the fastest routing of the sweep, combined, against row-tiled and all-one-shot, three
   alternating rounds at 2 x 150, 2 x 200 and 2 x 250 frames;
3. ``kernels``: kernels and µs per kernel name of one forward (``torch.profiler``, not replayed) for row-tiled and
   the greedy combination;
4. ``descent``: coordinate descent over the per-kind routings of :data:`WIDE` (more one-shot tiles per GEMM
   kind) plus attention and convolution tile settings, from the greedy pick, minimising the summed medians at
   2 x 150, 2 x 200 and 2 x 250 frames (two passes); then the result against row-tiled, all-one-shot and the
   shipped pair tiles, three alternating rounds, with each output's largest difference from the row-tiled one;
5. ``descent2``: the same search from the shipped pair tiles (:data:`SHIPPED`) over those sets widened by
   :data:`WIDER`, :data:`ATTN_WIDER` and :data:`CONV_WIDER`.

Session 23's call 2 ran ``descent`` before the pair tiles existed: its sets had no :data:`WIDER` entries, its
final comparison no ``shipped`` column, and its attention and conv settings were written into the tiles shared
by every row count.  The script now writes them into ``ATTN_PAIR`` and ``TUNING_PAIR``, which for these
forwards is the same thing.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import gpu_runner, step_args  # noqa: E402
from cosyvoice_fast.kernels import common as estimator_common
from cosyvoice_fast.flow.kernels import estimator_linear  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import estimator_inputs, graph_replay_ms, kernel_times  # noqa: E402

KINDS = {(1536, 256): "qkv", (1024, 256): "ff1", (256, 512): "out", (256, 1024): "ff2"}
#: one-shot tile variants per kind at a few hundred rows (the first is session 15's pick for > 256 rows)
TILES = {
    "qkv": {"a": {"bm": 64, "bn": 128, "warps": 8}, "b": {"bm": 32, "bn": 64, "warps": 4},
            "c": {"bm": 32, "bn": 128, "warps": 4}, "d": {"bm": 64, "bn": 64, "warps": 4}},
    "ff1": {"a": {"bm": 32, "bn": 64, "warps": 4}, "b": {"bm": 64, "bn": 64, "warps": 4},
            "c": {"bm": 16, "bn": 64, "warps": 4}, "d": {"bm": 32, "bn": 128, "warps": 4}},
    "out": {"a": {"bm": 64, "bn": 64, "warps": 4}, "b": {"bm": 16, "bn": 32, "warps": 4},
            "c": {"bm": 32, "bn": 32, "warps": 4}, "d": {"bm": 16, "bn": 16, "warps": 4}},
    "ff2": {"a": {"bm": 64, "bn": 16, "warps": 4, "bk": 256, "stages": 2},
            "b": {"bm": 32, "bn": 16, "warps": 4, "bk": 1024, "stages": 1},
            "c": {"bm": 32, "bn": 32, "warps": 4, "bk": 256, "stages": 2},
            "d": {"bm": 16, "bn": 32, "warps": 4, "bk": 256, "stages": 2}},
}
ALL_ONESHOT = {kind: "a" for kind in TILES}
#: the descent's wider one-shot tile sets (``TILES`` plus neighbours of the sweep's winners)
WIDE = {
    "qkv": {**TILES["qkv"], "e": {"bm": 32, "bn": 128, "warps": 8}, "f": {"bm": 16, "bn": 128, "warps": 4},
            "g": {"bm": 32, "bn": 256, "warps": 8}},
    "ff1": {**TILES["ff1"], "e": {"bm": 16, "bn": 128, "warps": 4}, "f": {"bm": 32, "bn": 128, "warps": 8},
            "g": {"bm": 64, "bn": 128, "warps": 8}},
    "out": {**TILES["out"], "e": {"bm": 32, "bn": 16, "warps": 4}, "f": {"bm": 64, "bn": 32, "warps": 4}},
    "ff2": {**TILES["ff2"], "e": {"bm": 16, "bn": 16, "warps": 4, "bk": 1024, "stages": 1},
            "f": {"bm": 32, "bn": 32, "warps": 4, "bk": 1024, "stages": 1},
            "g": {"bm": 64, "bn": 16, "warps": 4, "bk": 1024, "stages": 1}},
}
#: attention tiles and conv overrides of ``estimator_conv.TUNING`` for these forwards ("a": the tiles shared
#: with every row count, which these launches used before session 23)
ATTN = {"a": {"bm": 64, "bn": 64, "warps": 4, "stages": 3}, "b": {"bm": 32, "bn": 64, "warps": 4, "stages": 3},
        "c": {"bm": 64, "bn": 32, "warps": 4, "stages": 3}, "d": {"bm": 32, "bn": 128, "warps": 4, "stages": 3},
        "e": {"bm": 16, "bn": 64, "warps": 4, "stages": 3}}
CONV = {"a": {}, "b": {"bk": 256}, "c": {"min_programs": 0}, "d": {"bm": 16, "bn": 64}, "e": {"bk": 64}}
#: ``descent2``: neighbours of the shipped pair tiles (qkv g, ff1 f, out c, ff2 a, attention d, conv d)
WIDER = {
    "qkv": {"h": {"bm": 32, "bn": 256, "warps": 4}, "i": {"bm": 16, "bn": 256, "warps": 8},
            "j": {"bm": 64, "bn": 256, "warps": 8}},
    "ff1": {"h": {"bm": 32, "bn": 256, "warps": 8}, "i": {"bm": 16, "bn": 128, "warps": 8},
            "j": {"bm": 64, "bn": 256, "warps": 8}},
    "out": {"h": {"bm": 32, "bn": 64, "warps": 4}, "i": {"bm": 32, "bn": 32, "warps": 8},
            "j": {"bm": 16, "bn": 64, "warps": 4}},
    "ff2": {"h": {"bm": 64, "bn": 16, "warps": 4, "bk": 512, "stages": 2},
            "i": {"bm": 64, "bn": 32, "warps": 4, "bk": 256, "stages": 2},
            "j": {"bm": 128, "bn": 16, "warps": 4, "bk": 256, "stages": 2},
            "k": {"bm": 32, "bn": 16, "warps": 4, "bk": 256, "stages": 3},
            "l": {"bm": 64, "bn": 16, "warps": 4, "bk": 128, "stages": 3}},
}
ATTN_WIDER = {"f": {"bm": 32, "bn": 128, "warps": 4, "stages": 2}, "g": {"bm": 32, "bn": 128, "warps": 8, "stages": 3},
              "h": {"bm": 32, "bn": 256, "warps": 4, "stages": 2}, "i": {"bm": 16, "bn": 128, "warps": 4, "stages": 3},
              "j": {"bm": 64, "bn": 128, "warps": 4, "stages": 3}}
CONV_WIDER = {"f": {"bm": 16, "bn": 64, "bk": 256}, "g": {"bm": 16, "bn": 128}, "h": {"bm": 16, "bn": 32},
              "i": {"bm": 16, "bn": 64, "warps": 8}, "j": {"bm": 16, "bn": 64, "min_programs": 0},
              "k": {"bm": 16, "bn": 64, "ln_bm": 32}, "l": {"bm": 16, "bn": 64, "ln_warps": 4}}
SHIPPED = {"qkv": "g", "ff1": "f", "out": "c", "ff2": "a", "attn": "d", "conv": "d"}
for _kind, _extra in WIDER.items():
    WIDE[_kind].update(_extra)
ATTN.update(ATTN_WIDER)
CONV.update(CONV_WIDER)


def configs() -> dict[str, dict[str, str]]:
    """name -> {kind: "row" (row-tiled) or a tile variant}: row-tiled, all one-shot, then one kind varied at a
    time from all-one-shot, and each kind alone one-shot."""
    out = {"rowtiled": {k: "row" for k in TILES}, "oneshot": dict(ALL_ONESHOT)}
    for kind, variants in TILES.items():
        out[f"{kind}_row"] = {**ALL_ONESHOT, kind: "row"}
        for v in variants:
            if v != "a":
                out[f"{kind}_{v}"] = {**ALL_ONESHOT, kind: v}
    return out


class Routing:
    """Routes each few-rows ``linear`` call by its (N, K) kind: row-tiled, or one-shot with the given tiles."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}
        self.orig = estimator_linear.linear_oneshot

    def __call__(self, x, weight, bias=None, **kw):  # noqa: ANN001, ANN204
        kind = KINDS.get(tuple(weight.shape))
        choice = self.table.get(kind, "a") if kind else "a"
        if choice == "row":
            estimator_common.LAUNCH["oneshot"] = False
            try:
                return estimator_linear.linear(x, weight, bias, **kw)
            finally:
                estimator_common.LAUNCH["oneshot"] = True
        return self.orig(x, weight, bias, tiles=WIDE[kind][choice] if kind else None, **kw)


def full_fused_bf16() -> torch.nn.Module:
    """The full-size estimator (seeded random weights, bf16, CUDA) wrapped as the ``fused`` flow backend runs it."""
    from cosyvoice_fast.config.model import CFMConfig, DecoderConfig
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.flow.model.cfm import CausalCFM

    torch.manual_seed(0)
    return FusedEstimator(CausalCFM(CFMConfig(), DecoderConfig()).cuda().eval().to(torch.bfloat16).estimator)


def step_forward(fused: torch.nn.Module, rows: int, frames: int) -> Callable[[], torch.Tensor]:
    """One chunk-attention forward of ``rows`` x ``frames`` random bf16 inputs as the engine's step graphs run it
    (the time-table row given, so the time embedding is not recomputed)."""
    a = estimator_inputs(fused.cfg, rows, frames, torch.bfloat16)
    tall = fused.time_table(torch.full((1,), 0.3, device="cuda"), rows)[0]
    return lambda: fused(*a, True, tall=tall)


def main() -> int:
    out, steps = step_args("sweep,greedy,kernels,descent,descent2")
    runner = gpu_runner("first_forward_ab.py", out, step_timeout=240)
    fused = full_fused_bf16()
    route = Routing()
    estimator_linear.linear_oneshot = route
    estimator_common.LAUNCH.update(oneshot=True, oneshot_max_rows=1 << 30)
    calls: dict[int, Callable[[], torch.Tensor]] = {}

    def forward(frames: int) -> Callable[[], torch.Tensor]:
        if frames not in calls:
            calls[frames] = step_forward(fused, 2, frames)
        return calls[frames]

    from cosyvoice_fast.flow.kernels import estimator_attention, estimator_conv

    conv0 = dict(estimator_conv.TUNING)
    saved = dict(estimator_attention.ATTN_PAIR), dict(estimator_conv.TUNING_PAIR)

    def apply(table: dict[str, str]) -> None:
        """GEMM routing per kind, and the attention and conv tiles these pair-row launches take."""
        route.table = table
        estimator_attention.ATTN_PAIR.clear()
        estimator_attention.ATTN_PAIR.update(ATTN[table.get("attn", "a")])
        estimator_conv.TUNING_PAIR.clear()
        estimator_conv.TUNING_PAIR.update({**conv0, **CONV[table.get("conv", "a")]})

    def timed(table: dict[str, str], frames: int, iters: int = 50) -> float:
        apply(table)
        with torch.inference_mode():
            return graph_replay_ms(forward(frames), iters=iters)

    def output(table: dict[str, str], frames: int) -> torch.Tensor:
        apply(table)
        with torch.inference_mode():
            return forward(frames)().float()

    def sweep() -> dict:
        cfgs = configs()
        ref = output(cfgs["rowtiled"], 200)
        r: dict = {"diff_vs_rowtiled": {n: round((output(c, 200) - ref).abs().max().item(), 4)
                                        for n, c in cfgs.items()}, "ms": defaultdict(list)}
        for _ in range(3):
            for name, table in cfgs.items():
                r["ms"][name].append(round(timed(table, 200), 4))
        r["median_ms"] = {n: round(statistics.median(v), 4) for n, v in r["ms"].items()}
        return r

    def best_table() -> dict[str, str]:
        med = runner.results["sweep"]["median_ms"]
        table = {}
        for kind, variants in TILES.items():
            options = {"row": med[f"{kind}_row"], "a": med["oneshot"]}
            options.update({v: med[f"{kind}_{v}"] for v in variants if v != "a"})
            table[kind] = min(options, key=options.get)
        return table

    def greedy() -> dict:
        best = best_table()
        tables = {"rowtiled": {k: "row" for k in TILES}, "oneshot": dict(ALL_ONESHOT), "greedy": best}
        r: dict = {"greedy": best, "ms": {}}
        for _ in range(3):
            for frames in (150, 200, 250):
                for name, table in tables.items():
                    r["ms"].setdefault(f"2x{frames}", {}).setdefault(name, []).append(round(timed(table, frames), 4))
        r["median_ms"] = {s: {n: round(statistics.median(v), 4) for n, v in d.items()} for s, d in r["ms"].items()}
        return r

    def kernels() -> dict:
        r = {}
        tables = {"rowtiled": {k: "row" for k in TILES}}
        if runner.ok("sweep"):
            tables["greedy"] = best_table()
        for name, table in tables.items():
            apply(table)
            with torch.inference_mode():
                fn = forward(200)
                fn()
                times = kernel_times(fn)
            by: dict[str, list] = defaultdict(lambda: [0, 0.0])
            for kname, us in times:
                key = kname.split("(")[0][:48]
                by[key][0] += 1
                by[key][1] += us
            r[name] = {"kernels": len(times), "kernel_us": round(sum(us for _, us in times), 1),
                       "by_name": {k: [v[0], round(v[1], 1), round(v[1] / v[0], 2)]
                                   for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])}}
        return r

    def descent(cur: dict[str, str] | None = None) -> dict:
        dims = {**{k: ["row", *WIDE[k]] for k in WIDE}, "attn": list(ATTN), "conv": list(CONV)}
        if cur is None:  # call 2 of session 23: from the sweep's greedy pick, the shared attention and conv tiles
            start = best_table() if runner.ok("sweep") else dict(ALL_ONESHOT)
            cur = {**start, "attn": "a", "conv": "a"}
        shapes = (150, 200, 250)

        def cost(table: dict[str, str]) -> float:
            return round(sum(timed(table, f, iters=30) for f in shapes), 4)

        r: dict = {"start": dict(cur), "passes": []}
        best = cost(cur)
        for _ in range(2):
            tried = {}
            for dim, options in dims.items():
                for opt in options:
                    if opt == cur[dim]:
                        continue
                    cand = {**cur, dim: opt}
                    c = cost(cand)
                    tried[f"{dim}={opt}"] = c
                    if c < best - 0.005:
                        best, cur = c, cand
            r["passes"].append({"tried": tried, "best": dict(cur), "cost": best})
            runner.results["descent_partial"] = r
            runner.save()
        final = {"rowtiled": {k: "row" for k in TILES}, "oneshot": dict(ALL_ONESHOT), "shipped": dict(SHIPPED),
                 "descent": cur}
        ref = output(final["rowtiled"], 200)
        r["diff_vs_rowtiled_2x200"] = {n: round((output(t, 200) - ref).abs().max().item(), 4)
                                       for n, t in final.items()}
        ms: dict = {}
        for _ in range(3):
            for frames in (100, 150, 200, 250):
                for name, table in final.items():
                    ms.setdefault(f"2x{frames}", {}).setdefault(name, []).append(round(timed(table, frames), 4))
        r["final_ms"] = ms
        r["final_median_ms"] = {s: {n: round(statistics.median(v), 4) for n, v in d.items()} for s, d in ms.items()}
        return r

    steps_fns = (("sweep", sweep), ("greedy", greedy), ("kernels", kernels), ("descent", descent),
                 ("descent2", lambda: descent(dict(SHIPPED))))
    for name, fn in steps_fns:
        if name in steps:
            runner.run(name, fn, timeout=420 if name.startswith("descent") else None)
    estimator_attention.ATTN_PAIR.update(saved[0])
    estimator_conv.TUNING_PAIR.update(saved[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
