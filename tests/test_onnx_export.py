"""The flow estimator exported to ONNX (the TensorRT backend's input) matches eager fp32 under onnxruntime."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_fast.flow.onnx_export import (
    INPUT_NAMES, OUTPUT_NAME, estimator_fingerprint, example_inputs, export_estimator_onnx, export_flow_estimators,
    run_onnx,
)
from cosyvoice_fast.config.model import tiny_config
from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TOL = 1e-4  # measured ~2e-6 on the tiny config


@pytest.fixture(scope="module")
def estimator() -> CausalConditionalDecoder:
    torch.manual_seed(0)
    return CausalConditionalDecoder(tiny_config().flow.decoder).eval()


@pytest.fixture(scope="module")
def exported(estimator, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("onnx")
    return export_flow_estimators(estimator, out)


def test_both_attention_modes_are_written_with_a_dynamic_time_axis(exported, estimator):
    assert set(exported) == {"stream", "full"}
    fp = estimator_fingerprint(estimator)
    for mode, path in exported.items():
        assert path.name == f"flow_estimator_{mode}_{fp}_fp32.onnx"
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                  for i in model.graph.input}
        assert list(inputs) == list(INPUT_NAMES)
        assert inputs["x"] == [2, 80, "T"] and inputs["mask"] == [2, 1, "T"] and inputs["cond"] == [2, 80, "T"]
        assert inputs["t"] == [2] and inputs["spks"] == [2, 80]
        assert [o.name for o in model.graph.output] == [OUTPUT_NAME]


@pytest.mark.parametrize("mode", ["stream", "full"])
@pytest.mark.parametrize("frames", [77, 260])  # neither is the tracing length (200); 260 spans 6 attention chunks
def test_onnxruntime_matches_eager_fp32(exported, estimator, mode, frames):
    args = example_inputs(frames, seed=frames)
    with torch.inference_mode():
        ref = estimator(*args, mode == "stream")
    out = run_onnx(exported[mode], args)
    assert out.shape == ref.shape == (2, 80, frames)
    err = (out - ref).abs().max().item()
    assert err <= TOL, err


def test_modes_really_differ(exported, estimator):
    """The streaming export is chunk-causal: with > 50 frames it must differ from full attention."""
    args = example_inputs(120, seed=1)
    a, b = run_onnx(exported["stream"], args), run_onnx(exported["full"], args)
    assert (a[..., :50] - b[..., :50]).abs().max() > 1e-4
    with torch.inference_mode():
        assert (a - estimator(*args, True)).abs().max() <= TOL


def test_export_leaves_the_module_untouched(estimator, tmp_path):
    before = {k: v.clone() for k, v in estimator.state_dict().items()}
    export_estimator_onnx(estimator, tmp_path / "e.onnx", streaming=True, frames=120)
    after = estimator.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert next(estimator.parameters()).dtype == torch.float32
