"""HiFT per chunk on the GPU: the captured one-row graph replayed per chunk vs one eager batched filter pass.

    PYTHONUNBUFFERED=1 python benchmarks/hift_batch_check.py --out $OUT/hift_batch.json

Full-size HiFT of the synthetic model (random weights: same kernels and shapes), fp32, a first chunk's mel
(2 x 28 tokens = 56 frames) and a later one's (8 + 2 x 50 = 108 frames); rows 1, 2, 4, 8, 16.  CUDA-event
medians of the whole call as the engine makes it (excitation row by row, filter pass shared or replayed).
Each shape is a step under a time limit, and the JSON is rewritten after each (:mod:`benchmarks.steps`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda, time_call  # noqa: E402
from cosyvoice_fast.vocoder.graph import CudaGraphVocoder  # noqa: E402
from cosyvoice_fast.modeldir.files import load_models  # noqa: E402
from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT") or ".") / "hift_batch.json"),
                    help="results JSON (default: $OUT/hift_batch.json, else ./hift_batch.json)")
    ap.add_argument("--step-timeout", type=int, default=120, help="seconds per (frames, rows) shape")
    args = ap.parse_args()
    require_cuda("hift_batch_check.py")
    models = load_models(synthetic_model_dir("full"), device="cuda")
    voc = CudaGraphVocoder(models.hift, min_batch=1)
    runner = StepRunner(args.out, {"device": torch.cuda.get_device_name()}, step_timeout=args.step_timeout)

    def shape(frames: int, rows: int) -> dict:
        mels = torch.randn(rows, 80, frames, device="cuda") - 5
        srcs = torch.zeros(rows, 1, 0, device="cuda")
        gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(rows)]

        def per_row() -> list:
            return [voc.vocode(mels[i:i + 1], srcs[i:i + 1], gens[i]) for i in range(rows)]

        replay = time_call(per_row, 1, 10)["median_ms"]
        batch = time_call(lambda: voc.vocode_batch(mels, srcs, gens), 1, 10)["median_ms"]
        return {"graph_per_row_ms": round(replay, 2), "eager_batch_ms": round(batch, 2)}

    for frames in (56, 108):
        for rows in (1, 2, 4, 8, 16):
            runner.run(f"{frames}f_rows{rows}", lambda: shape(frames, rows))  # noqa: B023 - called at once
    return 0


if __name__ == "__main__":
    sys.exit(main())
