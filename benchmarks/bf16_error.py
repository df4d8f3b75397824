"""The error a served bf16 pipeline adds, in mel and in waveform, against the fp32 reference (docs/RESULTS.md).

    PYTHONUNBUFFERED=1 python benchmarks/bf16_error.py --out $OUT/bf16_error.json

``--synthetic full`` models (CosyVoice2-0.5B sizes, seeded random weights), one bench-shaped request (prompt 75
tokens, 150 speech tokens) cut into the default streaming schedule (chunks of 200 / 300 / 450 estimator frames;
the last with full attention).  Reference: the eager flow in fp32 and the eager HiFT in fp32, TF32 off.  For each
flow stage (eager, cudagraph, fused) in bf16, and fused in fp32, each chunk's new mel frames are compared with the
reference's; then each chunk's mel goes through the vocoder (eager fp32 HiFT, TF32 off, and the served ``fused``
HiFT with TF32 as torch defaults it) with the same generator, and the waveform is compared.  Reported: max,
p99.9 and mean |error| and the SNR in dB, per chunk and over the whole utterance.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402
from cosyvoice_fast.engine.stages import build_stage_set  # noqa: E402
from cosyvoice_fast.bench.engine_bench import synthetic_inputs  # noqa: E402
from cosyvoice_fast.config.backends import TORCH_DTYPES, BackendConfig
from cosyvoice_fast.config.stream import StreamParams  # noqa: E402
from cosyvoice_fast.config.engine import EngineConfig  # noqa: E402
from cosyvoice_fast.modeldir.files import load_models  # noqa: E402
from cosyvoice_fast.config.schedule import plan  # noqa: E402
from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir  # noqa: E402


def err_stats(wav: torch.Tensor, ref: torch.Tensor) -> dict[str, float | bool | None]:
    """Waveform error against the reference: max / p99.9 / mean |error| and SNR in dB (None when identical)."""
    d = (wav.double() - ref.double()).flatten()
    a = d.abs()
    k = max(1, int(round(0.999 * a.numel())))
    noise = d.pow(2).sum().item()
    signal = ref.double().pow(2).sum().item()
    return {"max_abs": a.max().item(), "p99.9_abs": a.kthvalue(k).values.item(), "mean_abs": a.mean().item(),
            "snr_db": round(10 * math.log10(signal / noise), 2) if noise > 0 else None,
            "finite": bool(torch.isfinite(wav).all())}

FLOWS = (("eager", "fp32"), ("eager", "bf16"), ("cudagraph", "bf16"), ("fused", "bf16"), ("fused", "fp32"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT") or ".") / "bf16_error.json"))
    ap.add_argument("--step-timeout", type=int, default=240, help="seconds per step (Triton compiles included)")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    require_cuda("bf16_error.py")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": args.seed}
    runner = StepRunner(args.out, res, step_timeout=args.step_timeout)
    models = load_models(synthetic_model_dir("full"), device="cuda")
    engine = EngineConfig(llm_slots=1, flow_rows=(1,), vocoder_rows=(1,), capture_at_start=False)
    inputs = synthetic_inputs(models.config, 75, 30, seed=args.seed).to("cuda")
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, models.config.flow.vocab_size, (1, 150), generator=g).cuda()
    calls = plan(75, 150, StreamParams())
    mels: dict[str, list[torch.Tensor]] = {}

    def flow_run(name: str, dtype: str) -> dict:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        flow = build_stage_set(models, BackendConfig(flow=name, dtype=dtype, incremental=False), engine).flow
        out = []
        cast = inputs.to("cuda", TORCH_DTYPES[dtype])  # as the engine hands them to its stages
        with torch.inference_mode():
            for call in calls:
                for _ in range(2):  # the second call replays the graphs the first captured
                    mel = flow.chunk(None, cast, tokens[:, :call.n_tokens], call, True).float()
                out.append(mel)
        mels[f"{name}_{dtype}"] = out
        return {"chunk_frames": [m.shape[-1] for m in out]}

    for name, dtype in FLOWS:
        runner.run(f"flow_{name}_{dtype}", lambda n=name, d=dtype: flow_run(n, d))

    def mel_errors() -> dict:
        ref = mels["eager_fp32"]
        r = {}
        for key, out in mels.items():
            if key == "eager_fp32":
                continue
            r[key] = {"utterance": err_stats(torch.cat(out, -1), torch.cat(ref, -1)),
                      "chunks": [err_stats(o, f) for o, f in zip(out, ref)]}
        return r

    runner.run("mel_vs_eager_fp32", mel_errors)

    def wav_errors() -> dict:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        eager = build_stage_set(models, BackendConfig(vocoder="eager"), engine).vocoder
        ref = []
        with torch.inference_mode():
            for m in mels["eager_fp32"]:
                gen = torch.Generator(device="cuda").manual_seed(7)
                ref.append(eager.vocode(m, torch.zeros(1, 1, 0, device="cuda"), gen)[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
        served = build_stage_set(models, BackendConfig(vocoder="fused"), engine).vocoder
        r = {}
        with torch.inference_mode():
            for key, out in mels.items():
                for vname, voc in (("eager_hift", eager), ("fused_hift_tf32", served)):
                    if vname == "eager_hift":
                        torch.backends.cudnn.allow_tf32 = False
                    wavs = []
                    for m in out:
                        gen = torch.Generator(device="cuda").manual_seed(7)
                        wavs.append(voc.vocode(m, torch.zeros(1, 1, 0, device="cuda"), gen)[0])
                    torch.backends.cudnn.allow_tf32 = True
                    r[f"{key}+{vname}"] = {"utterance": err_stats(torch.cat(wavs, -1), torch.cat(ref, -1)),
                                           "chunks": [err_stats(w, f) for w, f in zip(wavs, ref)]}
        return r

    runner.run("wav_vs_eager_fp32", wav_errors)
    for key in ("mel_vs_eager_fp32", "wav_vs_eager_fp32"):
        for name, e in (res.get(key) or {}).items():
            if isinstance(e, dict) and "utterance" in e:
                u = e["utterance"]
                print(f"{key:18s} {name:34s} max {u['max_abs']:.3g} p99.9 {u['p99.9_abs']:.3g} "
                      f"mean {u['mean_abs']:.3g} SNR {u['snr_db']} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
