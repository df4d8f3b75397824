"""HiFT (the vocoder) forward on the GPU at first-chunk shapes: where its time goes, and what TF32, bf16 or a CUDA
graph would buy for the batched pass.

    PYTHONUNBUFFERED=1 python benchmarks/hift_profile.py --out $OUT

Several streams' chunks share one eager fp32 HiFT pass (:meth:`CudaGraphVocoder.vocode_batch`), so at 16 rows
the vocoder is a first-chunk latency term; this measures the options for making that pass cheaper.

Model: the full-size HiFT (``HiFTConfig`` defaults, CosyVoice2's), built with seeded default init exactly as the
synthetic full model's ``hift.pt`` is (timing does not depend on weight values), with weight norm folded as the
engine does (:meth:`HiFTGenerator.remove_weight_norm`).  ``--model-dir`` loads a model directory's HiFT instead
(errors on trained weights say more about bf16).  Inputs as ``benchmarks/hift_batch_check.py``: mel ~ N(-5, 1)
of 56 frames (a first chunk: 2 x 28 tokens) and 106 frames, at 1 / 4 / 8 / 16 rows.

The timed forward is HiFT's whole call - f0 predictor, NSF source, filter network (the conv stack), iSTFT - with
the source's Gaussian noise drawn once beforehand (:meth:`HarmonicNoiseSource.from_noise`): the work of
:meth:`HiFTGenerator.inference` less one ``randn``, deterministic so that every variant sees the same inputs, and
capturable as a CUDA graph.

``results[variant][f"{frames}f_rows{rows}"]``: median / p95 / min ms of ``--iters`` calls after ``--warmup``
(CUDA events, each call from an idle GPU), and the waveform against ``fp32_no_tf32`` (max / p99.9 / mean |error|,
SNR in dB).  Variants:

- ``fp32_no_tf32`` (a): fp32, TF32 off for cuDNN convs and matmuls; the reference.
- ``fp32_tf32`` (b): fp32, TF32 on for both (PyTorch's default is on for cuDNN, off for matmuls, and the engine
  keeps the default: ``tf32_defaults`` records it).
- ``bf16_autocast_all`` (c): the whole forward under bf16 autocast.  Autocast has no rule for ``torch.stft`` or
  ``torch.complex``, so bf16 can reach HiFT's spectral ends; step ``bf16_autocast_plain_probe`` records whether that
  runs, and if it does not, (c) keeps the STFT and iSTFT in fp32 as (d) does (``notes`` says which); f0 predictor,
  source and conv stack are bf16 either way.
- ``bf16_autocast_conv_stack`` (d): f0 predictor, source, STFT and iSTFT in fp32, only the filter network under
  bf16 autocast.  ``decode`` has its two spectral ends as methods (``_source_spectrum``, ``_waveform``), so they
  are shadowed on the instance by wrappers that leave autocast: no model code is copied here.  (c) and (d) run
  with TF32 off, so what stays fp32 is true fp32 and their error against (a) is bf16's alone.
- ``cudagraph_fp32_no_tf32`` (e): (a) captured as one CUDA graph per shape (side-stream warm-up, then capture:
  :func:`cosyvoice_fast.kernels.graphs.capture`), replays timed; ``cudagraph_fp32_tf32``: the same under (b).
- ``cudagraph_fused_no_tf32`` / ``cudagraph_fused_tf32``: (e) and its TF32 twin on the ``fused`` vocoder's module
  (every Snake residual block as :class:`~cosyvoice_fast.vocoder.kernels.hift_snake.FusedSnakeResBlock`).

``profile_fp32_tf32_rows16``: torch.profiler over one (b) forward at 16 rows per mel length, the top 15 CUDA
kernels by total time (memcpy / memset left out); ``profile_fused_tf32_rows16`` the same for the fused module.
``--variants`` picks which variants run (the reference always does).  Every step runs under a time limit inside a total budget, and
the JSON is rewritten after each step (:mod:`benchmarks.steps`).  Needs a CUDA GPU (exit status 2 without one).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda, time_call  # noqa: E402
from cosyvoice_fast.config.model import full_config  # noqa: E402
from cosyvoice_fast.vocoder.model.hift import HiFTGenerator  # noqa: E402

REFERENCE = "fp32_no_tf32"
PROFILE_ROWS = 16
TOP_KERNELS = 15
SPECTRAL_METHODS = ("_source_spectrum", "_waveform")  # decode()'s STFT of the excitation, and its iSTFT
# where everything runs, autocast included (a constant so that a CPU check can walk the code; main() needs CUDA)
DEVICE_TYPE = "cuda"


@dataclasses.dataclass(frozen=True)
class Variant:
    """How one variant runs the forward: TF32 flags, where bf16 autocast applies, and whether it is a graph."""

    tf32: bool
    autocast: str | None = None  # None, "all" (the whole forward) or "conv_stack" (decode's filter network)
    graph: bool = False
    fused: bool = False  # the ``fused`` vocoder's module: residual units as fused Triton passes (kernels/hift_snake)
    time_major: bool = False  # with ``fused``: the conv stack on time-major activations (no cuDNN transposes)


VARIANTS = {
    "fp32_no_tf32": Variant(tf32=False),
    "fp32_tf32": Variant(tf32=True),
    # TF32 off: what autocast leaves in fp32 stays true fp32, so the error against (a) is bf16's alone
    "bf16_autocast_all": Variant(tf32=False, autocast="all"),
    "bf16_autocast_conv_stack": Variant(tf32=False, autocast="conv_stack"),
    "cudagraph_fp32_no_tf32": Variant(tf32=False, graph=True),
    "cudagraph_fp32_tf32": Variant(tf32=True, graph=True),
    "cudagraph_fused_no_tf32": Variant(tf32=False, graph=True, fused=True),
    "cudagraph_fused_tf32": Variant(tf32=True, graph=True, fused=True),
    "cudagraph_fused_tf32_time_major": Variant(tf32=True, graph=True, fused=True, time_major=True),
}


def forward(hift: HiFTGenerator, mel: Tensor, noise: Tensor) -> Tensor:
    """HiFT's whole call on (B, 80, T) mel with the source noise given: (B, T * 480) waveform."""
    return hift.decode(mel, hift.m_source.from_noise(hift.f0(mel), noise))


def forward_conv_stack_bf16(hift: HiFTGenerator, mel: Tensor, noise: Tensor) -> Tensor:
    """:func:`forward` with only ``decode`` under bf16 autocast (its spectral methods shadowed to fp32)."""
    source = hift.m_source.from_noise(hift.f0(mel), noise)
    with torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
        return hift.decode(mel, source)


@contextmanager
def fp32_methods(module: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Run ``module``'s methods ``names`` outside autocast on fp32 input while inside this block.

    The wrappers are instance attributes that shadow the class's methods (``decode`` calls ``self.<name>``), and
    are removed on exit, so the model is unchanged afterwards.
    """
    for name in names:
        method = getattr(module, name)

        def in_fp32(x: Tensor, _method: Callable[[Tensor], Tensor] = method) -> Tensor:
            with torch.autocast(DEVICE_TYPE, enabled=False):
                return _method(x.float())

        object.__setattr__(module, name, in_fp32)
    try:
        yield
    finally:
        for name in names:
            object.__delattr__(module, name)


@contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 for cuDNN convolutions and for matmuls both on or both off, restored on exit."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def err_stats(wav: Tensor, ref: Tensor) -> dict[str, float | bool | None]:
    """Waveform error against the reference: max / p99.9 / mean |error| and SNR in dB (None when identical)."""
    d = (wav.double() - ref.double()).flatten()
    a = d.abs()
    k = max(1, int(round(0.999 * a.numel())))
    noise = d.pow(2).sum().item()
    signal = ref.double().pow(2).sum().item()
    return {"max_abs": a.max().item(), "p99.9_abs": a.kthvalue(k).values.item(), "mean_abs": a.mean().item(),
            "snr_db": round(10 * math.log10(signal / noise), 2) if noise > 0 else None,
            "finite": bool(torch.isfinite(wav).all())}


def top_kernels(kernels: list[tuple[str, float]], top: int = TOP_KERNELS) -> dict:
    """(name, µs) per launched kernel -> count, total and the ``top`` names by total GPU time."""
    agg: dict[str, list] = {}
    for name, us in kernels:
        entry = agg.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    total = sum(us for _, us in kernels)
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kernels), "distinct": len(agg), "sum_kernel_ms": round(total / 1000, 3),
            "top": [{"name": name[:100], "count": count, "total_ms": round(us / 1000, 4),
                     "share": round(us / total, 3) if total else None} for name, (count, us) in ranked]}


def build_hift(model_dir: str | None) -> HiFTGenerator:
    """The vocoder on the GPU, weight norm folded (the engine's plain copy), eval, no grad."""
    if model_dir:
        from cosyvoice_fast.modeldir.files import load_models

        models = load_models(model_dir, device=DEVICE_TYPE, progress=False)
        hift = models.hift
        del models
        torch.cuda.empty_cache()
    else:
        # as cosyvoice_fast.modeldir.synthetic.write_synthetic_model_dir builds it (seed 0, default init, no taming),
        # without writing the 2 GB speech LM beside it
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hift = HiFTGenerator(full_config().hift)
        hift = hift.to(DEVICE_TYPE).eval().requires_grad_(False)
    return hift.remove_weight_norm().eval()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or ".",
                    help="directory for hift_profile.json (or a path ending in .json); default $OUT, else .")
    ap.add_argument("--frames", type=int, nargs="+", default=[56, 106], help="mel lengths")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="batch rows")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per shape (at least 2)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per shape first")
    ap.add_argument("--step-timeout", type=float, default=45.0, help="seconds per variant step")
    ap.add_argument("--budget", type=float, default=210.0,
                    help="seconds for all steps together; steps past it are recorded as skipped")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="variants to run (the reference fp32_no_tf32 is always run first)")
    ap.add_argument("--model-dir", default=None,
                    help="load HiFT from this model directory instead of the seeded synthetic full-size one")
    args = ap.parse_args(argv)
    if args.iters < 2:
        ap.error("--iters must be at least 2 (p95)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    require_cuda("hift_profile.py")
    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "hift_profile.json"
    res: dict = {
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "tf32_defaults": {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                          "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32},
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "model": args.model_dir or "synthetic full-size HiFT (seeded random init)",
        "frames": args.frames, "rows": args.rows, "iters": args.iters, "warmup": args.warmup,
        "timed_forward": "decode(mel, m_source.from_noise(f0(mel), noise)); noise drawn beforehand", "notes": {},
    }
    runner = StepRunner(out, res, step_timeout=args.step_timeout, budget_s=args.budget)
    state: dict = {}
    refs: dict[str, Tensor] = {}  # shape key -> reference waveform
    shapes = [(f, r) for f in args.frames for r in args.rows]

    def setup() -> dict:
        hift = build_hift(args.model_dir)
        state["hift"] = hift
        if any(VARIANTS[n].fused for n in args.variants):
            from cosyvoice_fast.vocoder.kernels.hift_snake import fuse_hift

            state["fused"] = build_hift(args.model_dir)
            state["fused_blocks"] = fuse_hift(state["fused"], time_major=False)
            state["fused_time_major"] = build_hift(args.model_dir)
            fuse_hift(state["fused_time_major"], time_major=True)
        state["inputs"] = {}
        g = torch.Generator(device=DEVICE_TYPE).manual_seed(0)
        for frames, rows in shapes:
            mel = torch.randn(rows, hift.cfg.in_channels, frames, device=DEVICE_TYPE, generator=g) - 5
            noise = torch.randn(hift.m_source.noise_shape(mel[:, 0]), device=DEVICE_TYPE, generator=g)
            state["inputs"][f"{frames}f_rows{rows}"] = mel, noise
        return {"params": sum(p.numel() for p in hift.parameters()), "config": dataclasses.asdict(hift.cfg)}

    if runner.run("setup", setup, timeout=max(args.step_timeout, 180 if args.model_dir else 90)) is None:
        print("setup failed: nothing measured", file=sys.stderr)
        return 1
    hift: HiFTGenerator = state["hift"]

    def probe_plain_autocast() -> dict:
        mel, noise = state["inputs"][f"{args.frames[0]}f_rows{args.rows[0]}"]
        try:
            with torch.inference_mode(), torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
                wav = forward(hift, mel, noise)
            torch.cuda.synchronize()
            return {"runs": True, "wav_dtype": str(wav.dtype)}
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            return {"runs": False, "error": f"{type(e).__name__}: {e}"[:400]}

    def shape_entry(name: str, v: Variant, key: str, spectral_fp32: bool) -> dict:
        mel, noise = state["inputs"][key]
        if v.graph:
            from cosyvoice_fast.kernels.graphs import capture

            module = (state["fused_time_major"] if v.time_major else state["fused"]) if v.fused else hift
            # a pool of its own: the graph and its memory go when this shape is done
            graph, wav_static = capture(lambda: forward(module, mel, noise), torch.device(DEVICE_TYPE),
                                        torch.cuda.graph_pool_handle(), warmup=args.warmup)

            def call() -> Tensor:
                graph.replay()
                return wav_static
        elif v.autocast == "all":
            def call() -> Tensor:
                with torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16):
                    return forward(hift, mel, noise)
        elif v.autocast == "conv_stack":
            def call() -> Tensor:
                return forward_conv_stack_bf16(hift, mel, noise)
        else:
            def call() -> Tensor:
                return forward(hift, mel, noise)
        seams = SPECTRAL_METHODS if v.autocast == "conv_stack" or (v.autocast == "all" and spectral_fp32) else ()
        with fp32_methods(hift, seams) if seams else nullcontext(), torch.inference_mode():
            wav = call().float().clone()
            entry: dict = time_call(call, args.warmup, args.iters)
        if name == REFERENCE:
            refs[key] = wav
        elif key in refs:
            entry[f"vs_{REFERENCE}"] = err_stats(wav, refs[key])
        else:
            entry[f"vs_{REFERENCE}"] = None  # the reference did not run at this shape
        return entry

    def run_variant(name: str, v: Variant) -> dict:
        r: dict = {}
        spectral_fp32 = v.autocast == "all" and not res.get("bf16_autocast_plain_probe", {}).get("runs", False)
        if v.autocast == "all":
            res["notes"][name] = ("STFT and iSTFT kept in fp32 (plain autocast fails: see bf16_autocast_plain_probe)"
                                  if spectral_fp32 else "plain autocast, nothing kept in fp32")
        elif v.autocast == "conv_stack":
            res["notes"][name] = "f0, source, STFT and iSTFT in fp32; decode's conv stack under bf16 autocast"
        if v.autocast:
            res["notes"][name] += "; TF32 off for what stays fp32"
        with tf32(v.tf32):
            for frames, rows in shapes:
                key = f"{frames}f_rows{rows}"
                try:
                    r[key] = shape_entry(name, v, key, spectral_fp32)
                except Exception as e:  # noqa: BLE001 - one shape failing (OOM, capture) must not hide the rest
                    r[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"  {name} {key}: {r[key]}", flush=True)
        return r

    def profile_rows16(module: HiFTGenerator) -> dict:
        from cosyvoice_fast.bench.estimator_profile import kernel_times

        r: dict = {}
        with tf32(True), torch.inference_mode():
            for frames in args.frames:
                mel = torch.randn(PROFILE_ROWS, hift.cfg.in_channels, frames, device=DEVICE_TYPE) - 5
                noise = torch.randn(hift.m_source.noise_shape(mel[:, 0]), device=DEVICE_TYPE)
                forward(module, mel, noise)  # warm-up: cuDNN picks its kernels outside the profile
                r[f"{frames}f_rows{PROFILE_ROWS}"] = top_kernels(kernel_times(lambda: forward(module, mel, noise)))
        return r

    chosen = [REFERENCE] + [n for n in args.variants if n != REFERENCE]
    for name in chosen:
        if name.startswith("bf16_autocast") and "bf16_autocast_plain_probe" not in res:
            runner.run("bf16_autocast_plain_probe", probe_plain_autocast, timeout=min(args.step_timeout, 30))
        runner.run(name, lambda: run_variant(name, VARIANTS[name]))  # noqa: B023 - called at once
    runner.run(f"profile_fp32_tf32_rows{PROFILE_ROWS}", lambda: profile_rows16(hift))
    if "fused" in state:
        runner.run(f"profile_fused_tf32_rows{PROFILE_ROWS}", lambda: profile_rows16(state["fused"]))
        runner.run(f"profile_fused_time_major_tf32_rows{PROFILE_ROWS}",
                   lambda: profile_rows16(state["fused_time_major"]))

    print_summary(res, shapes)
    failed = [k for k, s in res.get("step_status", {}).items() if s != "ok"]
    print(f"wrote {out}" + (f"; steps not ok: {', '.join(failed)}" if failed else ""), flush=True)
    return 0


def print_summary(res: dict, shapes: list[tuple[int, int]]) -> None:
    """Median ms per shape and variant, then the bf16 waveform SNRs, then the top kernels."""
    names = [n for n in VARIANTS if isinstance(res.get(n), dict) and "error" not in res[n]]
    print(f"\n== HiFT forward, {res['device']}, median ms (p95) ==")
    print("shape        | " + " | ".join(f"{n:>24s}" for n in names))
    for frames, rows in shapes:
        key = f"{frames}f_rows{rows}"
        cells = []
        for n in names:
            e = res[n].get(key, {})
            cell = f"{e['median_ms']:.3f} ({e['p95_ms']:.3f})" if "median_ms" in e else "-"
            cells.append(f"{cell:>24s}")
        print(f"{key:12s} | " + " | ".join(cells))
    for n in names:
        for key, e in res[n].items():
            err = e.get(f"vs_{REFERENCE}") if isinstance(e, dict) else None
            if err and n != REFERENCE:
                snr = "identical" if err["snr_db"] is None else f"SNR {err['snr_db']} dB"
                print(f"{n} {key}: {snr}, max |err| {err['max_abs']:.3g}, p99.9 {err['p99.9_abs']:.3g}, "
                      f"mean {err['mean_abs']:.3g}")
    prof = res.get(f"profile_fp32_tf32_rows{PROFILE_ROWS}", {})
    for key, p in prof.items() if isinstance(prof, dict) else ():
        if isinstance(p, dict) and "top" in p:
            print(f"\ntop kernels, fp32_tf32 {key}: {p['kernels']} kernels, {p['sum_kernel_ms']} ms")
            for k in p["top"]:
                print(f"  {k['total_ms']:9.3f} ms  x{k['count']:<4d} {k['name']}")


if __name__ == "__main__":
    sys.exit(main())
