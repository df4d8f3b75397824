"""Export the CFM estimator to ONNX (the first step of the TensorRT flow backend).

The graph has six inputs with a dynamic time axis ``T`` and a fixed CFG batch of 2:

=========  ===============  =====================================================
name       shape            meaning
=========  ===============  =====================================================
x          (2, 80, T)       the ODE state (same in both rows)
mask       (2, 1, T)        1 for real frames, 0 for padding
mu         (2, 80, T)       encoder output (row 1 zero)
t          (2,)             flow time
spks       (2, 80)          speaker condition (row 1 zero)
cond       (2, 80, T)       prompt mel on the first frames (row 1 zero)
velocity   (2, 80, T)       output
=========  ===============  =====================================================

The attention mode is fixed at export time (it changes the graph, not just values): ``streaming=True`` is
chunk-causal attention (non-final streaming chunks), ``streaming=False`` full attention (final chunks and
non-streaming requests).  :func:`export_flow_estimators` writes both.  The TorchScript-based exporter
(``dynamo=False``) is used: it needs no extra packages and handles the dynamic slicing of the chunk mask.

Part of the TensorRT flow backend, which is never run here (TensorRT cannot be installed on the machines this
project is developed and tested on): the ONNX graph is as far as it is verified (tests export it and compare
it with the estimator under onnxruntime).  Neither TensorRT nor onnxruntime is needed to import this module.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

INPUT_NAMES = ("x", "mask", "mu", "t", "spks", "cond")
OUTPUT_NAME = "velocity"
TIME_INPUTS = ("x", "mask", "mu", "cond")
OPSET = 18
MODES = {"stream": True, "full": False}


class EstimatorForExport(nn.Module):
    """The estimator with the attention mode bound, so every input is a tensor."""

    def __init__(self, estimator: nn.Module, streaming: bool):
        super().__init__()
        self.estimator = estimator
        self.streaming = streaming

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, self.streaming)


def example_inputs(frames: int, channels: int = 80, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", seed: int = 0) -> tuple[Tensor, ...]:
    """Random estimator inputs of ``frames`` frames in the order of :data:`INPUT_NAMES` (row 1 unconditional)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    x = r(1, channels, frames).expand(2, -1, -1).clone()
    mu = torch.cat([r(1, channels, frames), torch.zeros(1, channels, frames)])
    spks = torch.cat([r(1, channels), torch.zeros(1, channels)])
    cond = torch.zeros(2, channels, frames)
    cond[0, :, : frames // 3] = r(channels, frames // 3)
    t = torch.rand(1, generator=g).expand(2).clone()
    mask = torch.ones(2, 1, frames)
    return tuple(v.to(device=device, dtype=dtype) for v in (x, mask, mu, t, spks, cond))


def estimator_fingerprint(estimator: nn.Module) -> str:
    """8 hex digits identifying the estimator's *architecture* (parameter names and shapes).

    Deliberately blind to dtype: ``build_stage_set`` may hand a backend a bf16/fp16 copy of the model the
    engine was built from.  Weights are checked separately, with a tolerance (:func:`weight_probe`).
    """
    h = hashlib.sha256()
    for name, p in sorted(estimator.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:8]


def weight_probe(estimator: nn.Module, n: int = 256) -> list[float]:
    """``n`` weight values at fixed positions spread over every parameter (fp32), to recognise the weights an
    engine was built from after a dtype cast (compare with :func:`probe_matches`)."""
    params = [p for _, p in sorted(estimator.state_dict().items()) if p.numel() > 0]
    per = max(1, n // max(1, len(params)))
    out: list[float] = []
    for p in params:
        flat = p.detach().reshape(-1)
        m = min(per, flat.numel())
        idx = ((torch.arange(m) + 0.5) * flat.numel() / m).long().to(flat.device)
        out.extend(flat[idx].float().cpu().tolist())
    return out[:n] if len(out) > n else out


def probe_matches(a: list[float], b: list[float], rtol: float = 2e-2) -> bool:
    """Same weights up to a half-precision cast: the summed relative deviation is below ``rtol``."""
    if len(a) != len(b) or not a:
        return False
    ta, tb = torch.tensor(a), torch.tensor(b)
    return bool((ta - tb).abs().sum() <= rtol * tb.abs().sum().clamp(min=1e-12))


def export_estimator_onnx(estimator: nn.Module, path: str | Path, streaming: bool, frames: int = 200,
                          dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                          opset: int = OPSET) -> Path:
    """Write ``estimator`` (a :class:`CausalConditionalDecoder`) as ONNX with a dynamic time axis.

    The module is not modified (a copy in ``dtype`` on ``device`` is traced; default: its own device).
    ``frames`` is only the tracing length; it should be at least two attention chunks so the chunk-causal
    mask is traced generically.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device) if device is not None else next(estimator.parameters()).device
    est = copy.deepcopy(estimator).to(device=dev, dtype=dtype).eval()
    channels = est.cfg.out_channels
    wrapper = EstimatorForExport(est, streaming).eval()
    args = example_inputs(frames, channels, dtype, dev)
    dynamic = {n: {2: "T"} for n in (*TIME_INPUTS, OUTPUT_NAME)}
    with warnings.catch_warnings(), torch.no_grad():
        # The legacy exporter notes that it is legacy, and that the mask's stride-2 slice cannot be
        # constant-folded; neither matters here.
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, args, str(path), input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                          dynamic_axes=dynamic, opset_version=opset, do_constant_folding=True, dynamo=False)
    log.info("exported the flow estimator (%s attention, %s) to %s", "chunk-causal" if streaming else "full",
             str(dtype).replace("torch.", ""), path)
    return path


def onnx_name(mode: str, fingerprint: str, dtype: str = "fp32") -> str:
    """``flow_estimator_{mode}_{weights}_{dtype}.onnx`` (not ``*.plan``: the engine glob ignores it)."""
    return f"flow_estimator_{mode}_{fingerprint}_{dtype}.onnx"


def export_flow_estimators(estimator: nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.float32,
                           device: torch.device | str | None = None) -> dict[str, Path]:
    """Export both attention modes; returns ``{"stream": path, "full": path}``."""
    fp = estimator_fingerprint(estimator)
    tag = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return {mode: export_estimator_onnx(estimator, Path(out_dir) / onnx_name(mode, fp, tag), streaming,
                                        dtype=dtype, device=device)
            for mode, streaming in MODES.items()}


def run_onnx(path: str | Path, inputs: tuple[Tensor, ...], providers: list[str] | None = None) -> Tensor:
    """Run an exported estimator with onnxruntime (CPU by default) on torch inputs; returns the velocity."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=providers or ["CPUExecutionProvider"])
    feed = {n: v.detach().cpu().numpy() for n, v in zip(INPUT_NAMES, inputs)}
    return torch.from_numpy(sess.run([OUTPUT_NAME], feed)[0])
