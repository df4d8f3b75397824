"""``python -m cosyvoice_fast build-engines``: flow estimator -> ONNX -> TensorRT plans in ``engines/``.

Two plans are built, one per attention mode (``stream``: chunk-causal, for non-final streaming chunks;
``full``: final chunks and non-streaming requests), each with one optimization profile over the time axis.
TensorRT is imported lazily; ``--onnx-only`` needs neither TensorRT nor a GPU.

Engine files are only valid for the weights, GPU, TensorRT version, precision and shape range they were
built for, and the name says all of them::

    flow_estimator_{mode}_{weights}_{gpu}_trt{version}_{dtype}_T{min}-{opt}-{max}.plan

(``weights`` is :func:`.onnx_export.estimator_fingerprint`).  :mod:`.tensorrt` reads the name back to
pick a plan and to say why none fits.

Shape profile (:func:`profile_from_schedule`): ``min`` is one token after the shortest prompt considered,
``opt`` the median estimator length of the streamed schedule (upstream's hops 25 -> 50 -> 100 tokens) over
typical prompt lengths for a 10 s utterance, ``max`` the longest input served (default 3000 frames = 60 s,
prompt included); a longer input runs the eager estimator.

Precision: on TensorRT 10.x the network is weakly typed and ``fp16``/``bf16`` set the builder flag, with the
LayerNorms pinned to fp32 (fp16 LayerNorm after attention can overflow).  TensorRT 11 dropped the precision
flags; there the network is strongly typed and the ONNX is exported in the target dtype instead.

Never run here: TensorRT cannot be installed on the machines this project is developed and tested on, so this
code is verified only up to the ONNX graph (export, shapes, onnxruntime parity, plan naming and selection);
``tensorrt`` is imported lazily (:func:`~cosyvoice_fast.flow.tensorrt_build.import_tensorrt`), so importing
this module never needs it; ``--onnx-only`` is the part that runs here.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.schedule import schedule_frames
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.flow.graph import DEFAULT_MAX_FRAMES
from cosyvoice_fast.flow.onnx_export import INPUT_NAMES, MODES, TIME_INPUTS

log = logging.getLogger(__name__)

TRT_MISSING = "tensorrt is not installed (pip install -r requirements-trt.txt)"
ENGINE_PREFIX = "flow_estimator"
DTYPES = ("fp32", "fp16", "bf16")


class TensorRTNotInstalled(BackendUnavailable, ImportError):
    """The ``tensorrt`` package cannot be imported (a RuntimeError for the CLI, an ImportError for callers)."""


def import_tensorrt() -> Any:
    """``import tensorrt`` or raise :class:`TensorRTNotInstalled` with the install hint."""
    try:
        import tensorrt as trt  # type: ignore[import-not-found]
    except ImportError as e:
        raise TensorRTNotInstalled(f"{TRT_MISSING}; import failed: {e}") from e
    return trt


# ------------------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True, slots=True)
class FlowShapeProfile:
    """Min / opt / max estimator time length (frames) of one TensorRT optimization profile."""

    min_frames: int
    opt_frames: int
    max_frames: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_frames <= self.opt_frames <= self.max_frames:
            raise ValueError(f"shape profile needs 1 <= min <= opt <= max frames, got "
                             f"{self.min_frames}/{self.opt_frames}/{self.max_frames}")

    def shapes(self, name: str, channels: int = 80) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of input ``name`` (batch 2 = the CFG pair)."""
        if name == "t":
            return (2,), (2,), (2,)
        if name == "spks":
            return (2, channels), (2, channels), (2, channels)
        if name not in TIME_INPUTS:
            raise KeyError(f"unknown estimator input {name!r}")
        c = 1 if name == "mask" else channels
        return (2, c, self.min_frames), (2, c, self.opt_frames), (2, c, self.max_frames)

    def covers(self, frames: int) -> bool:
        return self.min_frames <= frames <= self.max_frames

    @property
    def tag(self) -> str:
        return f"T{self.min_frames}-{self.opt_frames}-{self.max_frames}"


def profile_from_schedule(prompt_tokens: Sequence[int] = (0, 50, 100, 150), utterance_tokens: int = 250,
                          params: StreamParams | None = None, max_frames: int = DEFAULT_MAX_FRAMES,
                          chunk_size: int = 25, token_mel_ratio: int = 2) -> FlowShapeProfile:
    """The profile the streamed chunk schedule asks for (see the module docstring)."""
    if not prompt_tokens:
        raise ValueError("give at least one prompt length")
    frames = [f for p in prompt_tokens
              for f, streaming in schedule_frames(p, utterance_tokens, params, chunk_size, token_mel_ratio)
              if streaming]
    lo = token_mel_ratio * (min(prompt_tokens) + 1)
    opt = int(statistics.median(frames)) if frames else lo
    opt = max(lo, min(opt, max_frames))
    return FlowShapeProfile(lo, opt, max_frames)


# ------------------------------------------------------------------------------------------------ naming


def slug(text: str) -> str:
    """Lower-case letters, digits, dots and dashes only (fields of an engine name never contain ``_``)."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "unknown"


def engine_name(mode: str, fingerprint: str, gpu: str, trt_version: str, dtype: str,
                profile: FlowShapeProfile) -> str:
    """File name of a flow-estimator plan; every field it depends on is in it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return (f"{ENGINE_PREFIX}_{mode}_{slug(fingerprint)}_{slug(gpu)}_trt{slug(trt_version)}_{dtype}_"
            f"{profile.tag}.plan")


_NAME_RE = re.compile(rf"^{ENGINE_PREFIX}_(?P<mode>[a-z]+)_(?P<fingerprint>[a-z0-9.-]+)_(?P<gpu>[a-z0-9.-]+)_"
                      r"trt(?P<trt>[a-z0-9.-]+)_(?P<dtype>fp32|fp16|bf16)_T(?P<min>\d+)-(?P<opt>\d+)-(?P<max>\d+)"
                      r"\.plan$")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The fields of an engine file name."""

    path: Path
    mode: str
    fingerprint: str
    gpu: str
    trt_version: str
    dtype: str
    profile: FlowShapeProfile


def parse_engine_name(path: str | Path) -> EngineInfo | None:
    """The fields of an engine file's name, or None if it is not one of ours."""
    p = Path(path)
    m = _NAME_RE.match(p.name)
    if m is None:
        return None
    return EngineInfo(p, m["mode"], m["fingerprint"], m["gpu"], m["trt"], m["dtype"],
                      FlowShapeProfile(int(m["min"]), int(m["opt"]), int(m["max"])))


def gpu_name(device: torch.device | int | None = None) -> str:
    if not torch.cuda.is_available():
        raise BackendUnavailable("building or running TensorRT engines needs a CUDA GPU (torch sees none here)")
    return torch.cuda.get_device_name(device)


def meta_path(plan: str | Path) -> Path:
    """The JSON written beside a plan (what it was built from, including a weight probe)."""
    return Path(str(plan) + ".json")


def write_engine_meta(plan: str | Path, meta: dict[str, Any]) -> Path:
    path = meta_path(plan)
    path.write_text(json.dumps(meta, indent=1))
    return path


def read_engine_meta(plan: str | Path) -> dict[str, Any] | None:
    path = meta_path(plan)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ builder


def _progress_monitor(trt: Any) -> Any | None:
    """A ``trt.IProgressMonitor`` drawing one tqdm bar per build phase (None if this TensorRT lacks it)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None
    from tqdm.auto import tqdm

    class TqdmProgress(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.bars: dict[str, Any] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, leave=False, position=len(self.bars))

        def step_complete(self, phase_name: str, step: int) -> bool:
            bar = self.bars.get(phase_name)
            if bar is not None:
                bar.update(step + 1 - bar.n)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return TqdmProgress()


def strongly_typed_only(trt: Any) -> bool:
    """TensorRT 11 removed the weak-typing precision flags (``BuilderFlag.FP16`` & co.)."""
    return not hasattr(trt.BuilderFlag, "FP16")


def build_flow_engine(onnx_path: str | Path, plan_path: str | Path, profile: FlowShapeProfile, fp16: bool = True,
                      *, dtype: str | None = None, workspace_gib: float = 4.0, progress: bool = True,
                      channels: int = 80) -> Path:
    """Build and save one TensorRT plan from an exported estimator ONNX.

    ``dtype`` ("fp32" / "fp16" / "bf16") overrides ``fp16``.  On TensorRT 10 (weakly typed) the precision is a
    builder flag; on TensorRT 11 the network is strongly typed and the ONNX must already be in that dtype.
    """
    trt = import_tensorrt()
    precision = dtype or ("fp16" if fp16 else "fp32")
    if precision not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {precision!r}")
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strong = strongly_typed_only(trt)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strong else 0
    network = builder.create_network(flags)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if not strong and precision != "fp32":
        config.set_flag(trt.BuilderFlag.FP16 if precision == "fp16" else trt.BuilderFlag.BF16)
        # LayerNorm (and the softmax statistics) overflow easily in fp16: keep normalisation in fp32.
        config.set_flag(trt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.NORMALIZATION:
                layer.precision = trt.float32
                layer.set_output_type(0, trt.float32)
    opt_profile = builder.create_optimization_profile()
    for name in INPUT_NAMES:
        lo, opt, hi = profile.shapes(name, channels)
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    monitor = _progress_monitor(trt) if progress else None
    if monitor is not None:
        try:
            config.progress_monitor = monitor
        except AttributeError:
            monitor = None

    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {plan_path.name} (see the TensorRT log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = plan_path.with_suffix(".plan.tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan_path)
    log.info("built %s in %.0f s (%.1f MiB)", plan_path.name, time.perf_counter() - t0,
             plan_path.stat().st_size / 2**20)
    return plan_path


# ------------------------------------------------------------------------------------------------ the CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_fast build-engines",
                                description="export the flow estimator to ONNX and build TensorRT engines")
    p.add_argument("--model-dir")
    p.add_argument("--synthetic", choices=["tiny", "full"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp16", choices=list(DTYPES), help="engine precision (default fp16)")
    p.add_argument("--engines-dir", default="engines")
    p.add_argument("--onnx-only", action="store_true")
    p.add_argument("--max-frames", type=int, default=DEFAULT_MAX_FRAMES)
    return p


def _load_flow(model_dir: str | None, synthetic: str | None) -> torch.nn.Module:
    from cosyvoice_fast.modeldir.files import find_model_dir, load_models
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    found = None if synthetic else find_model_dir(model_dir)
    if found is None:
        size = synthetic or "tiny"
        log.warning("building engines for a SYNTHETIC %s model (random weights): they only serve that model", size)
        found = synthetic_model_dir(size)
    return load_models(found, device="cpu", dtype=torch.float32).flow


def build_engines_cli(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Export both estimator ONNX files and (unless ``onnx_only``) build both TensorRT plans.

    ``args`` is the namespace of ``python -m cosyvoice_fast build-engines`` or an argv list.  Its ``dtype``
    (``--dtype``) is the engine precision; ``engine_dtype``, if present, takes precedence.
    """
    from tqdm.auto import tqdm

    from cosyvoice_fast.flow.onnx_export import estimator_fingerprint, export_flow_estimators, weight_probe

    a = args if isinstance(args, argparse.Namespace) else _parser().parse_args(list(args or []))
    precision = getattr(a, "engine_dtype", None) or getattr(a, "dtype", None) or "fp16"
    onnx_only = bool(getattr(a, "onnx_only", False))
    max_frames = int(getattr(a, "max_frames", DEFAULT_MAX_FRAMES))
    engines = Path(getattr(a, "engines_dir", "engines"))

    trt = None
    if not onnx_only:  # fail before the slow part if the build cannot happen here
        trt = import_tensorrt()
        gpu = gpu_name()
    flow = _load_flow(getattr(a, "model_dir", None), getattr(a, "synthetic", None))
    est = flow.decoder.estimator
    fp = estimator_fingerprint(est)
    # TensorRT 11 builds strongly typed networks: precision comes from the ONNX itself.
    onnx_dtype = torch.float32
    if trt is not None and strongly_typed_only(trt) and precision != "fp32":
        onnx_dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    steps = tqdm(total=2 if onnx_only else 4, desc="build-engines", unit="step")
    steps.set_postfix_str("ONNX export")
    onnx_paths = export_flow_estimators(est, engines, dtype=onnx_dtype,
                                        device="cuda" if onnx_dtype != torch.float32 else "cpu")
    steps.update(2)
    if onnx_only:
        steps.close()
        for mode, path in onnx_paths.items():
            print(f"{mode}: {path}")
        return 0

    profile = profile_from_schedule(max_frames=max_frames, token_mel_ratio=flow.cfg.token_mel_ratio)
    built = []
    for mode, onnx_path in onnx_paths.items():
        plan = engines / engine_name(mode, fp, gpu, trt.__version__, precision, profile)
        steps.set_postfix_str(f"TensorRT {mode}")
        build_flow_engine(onnx_path, plan, profile, dtype=precision, channels=est.cfg.out_channels)
        write_engine_meta(plan, {"mode": mode, "fingerprint": fp, "gpu": gpu, "trt_version": trt.__version__,
                                 "dtype": precision, "profile": [profile.min_frames, profile.opt_frames,
                                                                 profile.max_frames],
                                 "onnx": onnx_path.name, "weight_probe": weight_probe(est)})
        built.append(plan)
        steps.update(1)
    steps.close()
    for plan in built:
        print(plan)
    print(f"flow backend 'tensorrt' is ready ({precision}, {profile.min_frames}..{profile.max_frames} frames)")
    return 0
