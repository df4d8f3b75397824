"""One GPU call: where the nucleus draw's time goes (:mod:`cosyvoice_fast.llm.kernels.nucleus_topk`), one row of the
speech vocabulary (6564 ids, top_k 25, top_p 0.8), flat rows as the random-weight model gives them.

    PYTHONUNBUFFERED=1 python benchmarks/nucleus_draw_check.py --out $OUT

Times (median of 20 replays of a CUDA graph of 100 launches, µs per launch) the shipped kernel with the floor
on and off, on with 4 and 16 warps against the launcher's 8, and the draw before session 28 (``--old FILE``:
that module's source, loaded apart).  A single program's running time here follows its code size as much as
its arithmetic (BENCHMARKS.md, session 28), so the instruction count of each build is recorded too where
``cuobjdump`` is at hand.  Results: ``OUT/nucleus_draw_check.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosyvoice_fast.llm.kernels import nucleus_topk as nt  # noqa: E402
from benchmarks.steps import require_cuda  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import replay_median_ms  # noqa: E402
from cosyvoice_fast.llm.kernels.nucleus_topk import SCRATCH  # noqa: E402


def _time(fn, launches: int = 100) -> float:
    """µs per call of ``fn``: median of 20 replays of a graph of ``launches`` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    return round(replay_median_ms(g, iters=20) * 1e3 / launches, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--old", default=None, help="the nucleus_topk.py of the tree before (its draw kernel is timed)")
    a = ap.parse_args()
    require_cuda("nucleus_draw_check.py")
    vocab, k = 6564, 25
    g = torch.Generator(device="cuda").manual_seed(0)
    probs = (torch.randn(1, vocab, device="cuda", generator=g) * 0.5).softmax(-1)
    q = torch.empty(1, k, device="cuda").exponential_(generator=g)
    limit = torch.tensor(0.8, device="cuda")
    out = torch.empty(1, dtype=torch.int64, device="cuda")
    scratch = torch.empty(1, SCRATCH.value, dtype=torch.int64, device="cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "vocab": vocab, "top_k": k,
                 "candidates": int(nt.candidate_count(probs, k)[0]), "us_per_launch": {}}
    times = res["us_per_launch"]
    for floor in (True, False, True, False):
        nt.USE_FLOOR = floor
        name = "shipped_floor" if floor else "shipped_walk"
        times.setdefault(name, []).append(_time(lambda: nt.nucleus_draw_rows(probs, q, limit, out=out)))
    nt.USE_FLOOR = True
    shape = nt.draw_shape(vocab, k)
    res["sass_instructions"] = {}
    for warps in (8, 4, 16):
        def launch():  # noqa: ANN202
            return nt._nucleus_draw_kernel[(1,)](probs, q, limit, scratch, out, vocab, k, vocab, k, **shape,
                                                 num_warps=warps)
        times[f"shipped_floor_warps{warps}"] = [_time(launch) for _ in range(2)]
        try:
            sass = launch().asm["sass"]
            res["sass_instructions"][f"warps{warps}"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
        except Exception as e:  # noqa: BLE001 - the count is a by-product; record why it is missing
            res["sass_instructions"][f"warps{warps}"] = f"{type(e).__name__}: {e}"[:200]
    if a.old:
        spec = importlib.util.spec_from_file_location("cosyvoice_fast.kernels._old_nucleus_topk", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        for _ in range(2):
            times.setdefault("before_session28", []).append(
                _time(lambda: old.nucleus_draw_rows(probs, q, limit, out=out)))
    print(json.dumps(res, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "nucleus_draw_check.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
