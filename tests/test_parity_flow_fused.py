"""The fused estimator (Triton kernels; on CPU through the interpreter) against upstream's recorded first
estimator call of the parity fixture, in fp32."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402

TOL = 1e-4


def test_fused_estimator_reproduces_the_recorded_call(tiny_models, load_case):
    case = load_case("case_flow")
    ei = case["estimator_inputs"]
    est = tiny_models.flow.decoder.estimator
    fused = FusedEstimator(est)
    with torch.no_grad():
        out = fused(ei["x"], ei["mask"], ei["mu"], ei["t"], ei["spks"], ei["cond"],
                    streaming=bool(case["estimator_streaming"]))
    assert out.shape == case["estimator_output"].shape
    assert (out - case["estimator_output"]).abs().max().item() <= TOL
