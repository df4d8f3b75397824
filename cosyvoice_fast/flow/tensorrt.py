"""The ``tensorrt`` flow backend: the CFM estimator runs as a TensorRT plan built by ``build-engines``.

The encoder stays eager; every Euler step's estimator call (the CFG batch of 2) is one ``execute_async_v3`` on
the caller's current torch stream, so it orders with the surrounding torch kernels without a host sync.

Concurrency: each plan has a small pool of execution contexts behind a queue.  A request takes a context,
enqueues its work and puts the context back with a CUDA event recorded after the work; whoever takes it next
makes its own stream wait on that event before reusing the context's activation memory.

Engine choice (:func:`select_engine`): plans in ``engines/`` whose name matches this estimator's architecture,
this GPU and this TensorRT version, preferring the precision of the module (then fp16, bf16, fp32) and the
widest shape range; the weight probe beside the plan must match this model's weights (up to a dtype cast).
When nothing fits, :class:`~cosyvoice_fast.config.backends.BackendUnavailable` says which field differs and how
to rebuild.  Inputs longer than the plan's profile run the eager estimator (logged once, counted in
``eager_calls``).  A plan serves one request's CFG pair, so calls are not batched (``max_batch`` 1).

Never run here: TensorRT cannot be installed on the machines this project is developed and tested on, so this
code is verified only up to the ONNX graph (export, shapes, onnxruntime parity, plan naming and selection);
``tensorrt`` is imported lazily (:func:`~cosyvoice_fast.flow.tensorrt_build.import_tensorrt`), so importing
this module never needs it.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.schedule import ChunkCall
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.flow.eager import ChunkItem, flow_chunk_mel
from cosyvoice_fast.flow.onnx_export import (
    INPUT_NAMES, OUTPUT_NAME, estimator_fingerprint, probe_matches, weight_probe,
)
from cosyvoice_fast.flow.tensorrt_build import (
    ENGINE_PREFIX, EngineInfo, import_tensorrt, parse_engine_name, read_engine_meta, slug,
)

log = logging.getLogger(__name__)

REBUILD = "rebuild on this machine: python -m cosyvoice_fast build-engines --model-dir DIR --dtype fp16"
_DTYPE_ORDER = ("fp16", "bf16", "fp32")
_TORCH_TO_TAG = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def select_engine(plans: Iterable[str | Path], mode: str, fingerprint: str, gpu: str, trt_version: str,
                  prefer_dtype: str = "fp16", where: str = "engines/") -> EngineInfo:
    """The best plan for ``mode`` among ``plans``, or :class:`BackendUnavailable` naming the mismatch."""
    infos = [i for i in (parse_engine_name(p) for p in plans) if i is not None and i.mode == mode]
    if not infos:
        return _unavailable(f"no TensorRT flow engine for {mode} attention in {where}: run python -m "
                            f"cosyvoice_fast build-engines --model-dir DIR")
    same_model = [i for i in infos if i.fingerprint == slug(fingerprint)]
    if not same_model:
        found = ", ".join(sorted({i.fingerprint for i in infos}))
        return _unavailable(f"the TensorRT flow engines in {where} were built for another model architecture "
                            f"({found}; this estimator is {fingerprint}); {REBUILD}")
    same_gpu = [i for i in same_model if i.gpu == slug(gpu)]
    if not same_gpu:
        found = ", ".join(sorted({i.gpu for i in same_model}))
        return _unavailable(f"the TensorRT flow engines in {where} were built for another GPU ({found}); this "
                            f"GPU is {slug(gpu)}. Engines do not move between GPU models; {REBUILD}")
    same_trt = [i for i in same_gpu if i.trt_version == slug(trt_version)]
    if not same_trt:
        found = ", ".join(sorted({i.trt_version for i in same_gpu}))
        return _unavailable(f"the TensorRT flow engines in {where} were built with TensorRT {found}; "
                            f"TensorRT {trt_version} is installed; {REBUILD}")
    order = [prefer_dtype] + [d for d in _DTYPE_ORDER if d != prefer_dtype]
    return min(same_trt, key=lambda i: (order.index(i.dtype), -i.profile.max_frames, i.profile.min_frames,
                                        i.path.name))


def _unavailable(msg: str) -> EngineInfo:
    raise BackendUnavailable(msg)


def _torch_dtype(trt: Any, dt: Any) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if dt not in table:
        raise BackendUnavailable(f"the TensorRT flow engine has an unsupported I/O dtype {dt}; {REBUILD}")
    return table[dt]


class TrtEstimatorEngine:
    """One deserialized plan with a pool of execution contexts; called like the estimator (no ``streaming``
    argument: the attention mode is baked into the plan)."""

    def __init__(self, info: EngineInfo, trt: Any, n_contexts: int = 2):
        self.info = info
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        engine = self.runtime.deserialize_cuda_engine(info.path.read_bytes())
        if engine is None:
            raise BackendUnavailable(f"TensorRT {trt.__version__} could not load {info.path.name} (built with "
                                     f"TensorRT {info.trt_version} for {info.gpu}, or the file is damaged); "
                                     f"{REBUILD}")
        self.engine = engine
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        if names != set(INPUT_NAMES) | {OUTPUT_NAME}:
            raise BackendUnavailable(f"{info.path.name} is not a flow-estimator engine (its tensors are "
                                     f"{sorted(names)}); {REBUILD}")
        self.dtypes = {n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        lo, _, hi = engine.get_tensor_profile_shape("x", 0)
        self.min_frames, self.max_frames = int(lo[2]), int(hi[2])
        self.pool: queue.Queue[tuple[Any, torch.cuda.Event | None]] = queue.Queue()
        for _ in range(max(1, n_contexts)):
            ctx = engine.create_execution_context()
            if ctx is None:
                raise BackendUnavailable(f"TensorRT could not create an execution context for {info.path.name} "
                                         "(out of GPU memory?)")
            self.pool.put((ctx, None))

    def covers(self, frames: int) -> bool:
        return self.min_frames <= frames <= self.max_frames

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        stream = torch.cuda.current_stream(x.device)
        ctx, last = self.pool.get()
        done: torch.cuda.Event | None = last
        try:
            if last is not None:
                stream.wait_event(last)  # the context's previous run (maybe on another stream) has finished
            feeds = []
            for name, v in zip(INPUT_NAMES, (x, mask, mu, t.reshape(-1).expand(x.shape[0]), spks, cond)):
                v = v.to(self.dtypes[name]).contiguous()
                feeds.append(v)  # alive until enqueued; later reuse of the memory is ordered on this stream
                if not ctx.set_input_shape(name, tuple(v.shape)):
                    raise ValueError(f"{self.info.path.name} does not accept {name} of shape {tuple(v.shape)} "
                                     f"(profile {self.min_frames}..{self.max_frames} frames, batch 2)")
                ctx.set_tensor_address(name, v.data_ptr())
            out = torch.empty(tuple(ctx.get_tensor_shape(OUTPUT_NAME)), dtype=self.dtypes[OUTPUT_NAME],
                              device=x.device)
            ctx.set_tensor_address(OUTPUT_NAME, out.data_ptr())
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT failed to enqueue {self.info.path.name}")
            done = torch.cuda.Event()
            done.record(stream)
        finally:
            self.pool.put((ctx, done))
        return out.to(x.dtype)


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None: a CUDA GPU, and with
    ``engines_dir`` given the tensorrt package and an engine built there."""
    missing = cuda_missing(device)
    if missing is not None or engines_dir is None:
        return missing
    if importlib.util.find_spec("tensorrt") is None:
        return "package tensorrt is not installed (pip install -r requirements-trt.txt)"
    if not any(Path(engines_dir).glob(f"{ENGINE_PREFIX}*.plan")):
        return "no engine built yet: run python -m cosyvoice_fast build-engines --model-dir DIR"
    return None


def why_unavailable(flow: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``flow`` here (its device), or None when it can."""
    reason = why_unavailable_on(next(flow.parameters()).device)
    return None if reason is None else f"flow backend 'tensorrt' {reason}; choose 'eager' instead"


class TensorRTFlow:
    """Flow stage: eager encoder, TensorRT estimator (one plan per attention mode)."""

    max_batch = 1  # FlowStage: a plan's batch is one request's CFG pair, so solves are not shared
    incremental = None  # FlowStage: keeps no flow state between chunks

    def __init__(self, flow: torch.nn.Module, config: ModelConfig, engines_dir: str | Path = "engines",
                 n_contexts: int = 2):
        reason = why_unavailable(flow)
        if reason is not None:
            raise BackendUnavailable(reason)
        trt = import_tensorrt()  # TensorRTNotInstalled is a BackendUnavailable with the install hint
        self.flow = flow
        self.config = config
        est = flow.decoder.estimator
        self.eager_estimator = est
        param = next(flow.parameters())
        engines = Path(engines_dir)
        plans = sorted(engines.glob(f"{ENGINE_PREFIX}_*.plan"))
        fp = estimator_fingerprint(est)
        gpu = torch.cuda.get_device_name(param.device)
        prefer = _TORCH_TO_TAG.get(param.dtype, "fp16")
        if prefer == "fp32":
            prefer = "fp16"  # an fp32 module still gets the fast plan when one exists
        probe = None
        self.engines: dict[bool, TrtEstimatorEngine] = {}
        for mode, streaming in (("stream", True), ("full", False)):
            info = select_engine(plans, mode, fp, gpu, trt.__version__, prefer, where=f"{engines}/")
            meta = read_engine_meta(info.path)
            if meta is not None and "weight_probe" in meta:
                probe = weight_probe(est) if probe is None else probe
                if not probe_matches(probe, meta["weight_probe"]):
                    raise BackendUnavailable(f"{info.path.name} was built from other weights than this model's "
                                             f"(same architecture); {REBUILD}")
            elif meta is None:
                log.warning("%s has no metadata file: cannot check it was built from these weights", info.path.name)
            self.engines[streaming] = TrtEstimatorEngine(info, trt, n_contexts)
            log.info("flow estimator (%s attention): %s", mode, info.path.name)
        self.eager_calls = 0
        self._warned = False
        self._lock = threading.Lock()

    def estimator(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                  streaming: bool = False) -> Tensor:
        """The estimator's calling convention, dispatched to the plan of the attention mode."""
        eng = self.engines[bool(streaming)]
        frames = x.shape[-1]
        if x.shape[0] != 2 or not eng.covers(frames):
            with self._lock:
                self.eager_calls += 1
                if not self._warned:
                    self._warned = True
                    log.warning("estimator input of %d frames is outside %s's shape range %d..%d; running it "
                                "eagerly (rebuild the engines with a larger max_frames to cover it)", frames,
                                eng.info.path.name, eng.min_frames, eng.max_frames)
            return self.eager_estimator(x, mask, mu, t, spks, cond, streaming)
        return eng(x, mask, mu, t, spks, cond)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream, self.estimator)

    def solve(self, items: Sequence[ChunkItem], stream: bool = True) -> list[Tensor]:
        """FlowStage: one :meth:`chunk` per item, in order (the plans take one request at a time)."""
        return [self.chunk(*item, stream=stream) for item in items]
