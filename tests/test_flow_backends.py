"""Flow estimator backends (``cudagraph``, ``tensorrt``): the claims they rest on, checked on CPU, and parity with
eager on a GPU.

CPU: right zero-padding (the length-bucket trick) leaves real frames unchanged; the bucket policy and the shape
profile follow the chunk schedule; engine names carry every field they depend on; without CUDA / TensorRT the
backends refuse with a reason.  GPU tests are marked ``gpu`` and skip without CUDA
(``python -m pytest -m gpu tests/test_flow_backends.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.flow.graph import CudaGraphFlow
from cosyvoice_fast.flow.eager import EagerFlow, flow_chunk_mel
from cosyvoice_fast.flow.onnx_export import estimator_fingerprint, example_inputs, probe_matches, weight_probe
from cosyvoice_fast.flow.tensorrt_build import (
    TRT_MISSING, FlowShapeProfile, TensorRTNotInstalled, build_engines_cli, build_flow_engine, engine_name,
    parse_engine_name, profile_from_schedule,
)
from cosyvoice_fast.flow.tensorrt import TensorRTFlow, select_engine
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.model import tiny_config
from cosyvoice_fast.frontend.request import ModelInputs
from cosyvoice_fast.config.schedule import bucket_frames, call_frames, plan, schedule_frames

HAS_CUDA = torch.cuda.is_available()
_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


PAD_TOL = 1e-5
pytestmark = pytest.mark.usefixtures("no_tf32")  # true fp32 references (fixture in conftest)


def pad_estimator_inputs(x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, frames: int
                         ) -> tuple[torch.Tensor, ...]:
    """Zero-pad the time axis of ``x``, ``mask``, ``mu``, ``cond`` on the right to ``frames`` (what a graph
    runner does to a call shorter than its bucket)."""
    pad = frames - x.shape[-1]
    f = torch.nn.functional.pad
    return f(x, (0, pad)), f(mask, (0, pad)), f(mu, (0, pad)), f(cond, (0, pad))


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_flow_stream")


def _inputs(case: dict, device="cpu", dtype=torch.float32) -> ModelInputs:
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])], flow_prompt_speech_token=case["prompt_token"],
                         prompt_feat=case["prompt_feat"], embedding=case["embedding"])
    return inputs.to(device, dtype)


class PaddedEstimator:
    """What the graph backend does minus the graph: pad to the bucket, run, keep the real frames."""

    def __init__(self, estimator, extra: int = 0):
        self.estimator, self.extra, self.frames = estimator, extra, []

    def __call__(self, x, mask, mu, t, spks, cond, streaming):
        n = x.shape[-1]
        b = bucket_frames(n) + self.extra
        self.frames.append((n, b))
        xp, mp, mup, cp = pad_estimator_inputs(x, mask, mu, cond, b)
        return self.estimator(xp, mp, mup, t, spks, cp, streaming)[..., :n]


# ------------------------------------------------------------------------------------ padding invariance (CPU)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("frames", [37, 100, 133])
def test_right_padding_leaves_real_frames_unchanged(flow, streaming, frames):
    est = flow.decoder.estimator
    args = example_inputs(frames, seed=frames)
    x, mask, mu, t, spks, cond = args
    with torch.inference_mode():
        ref = est(*args, streaming)
        for target in (bucket_frames(frames), bucket_frames(frames) + 150):
            xp, mp, mup, cp = pad_estimator_inputs(x, mask, mu, cond, target)
            # garbage (finite) in the padded region must not matter either: the mask removes it
            xp[..., frames:] = 3.0
            mup[..., frames:] = -2.0
            out = est(xp, mp, mup, t, spks, cp, streaming)
            err = (out[..., :frames] - ref).abs().max().item()
            assert err <= PAD_TOL, (target, err)
            assert torch.count_nonzero(out[..., frames:]) == 0  # padded frames are masked to zero


def test_padded_estimator_gives_the_eager_chunks_over_a_streamed_schedule(flow, case):
    """The whole flow call (encoder + 10 guided Euler steps) with a bucket-padded estimator equals eager."""
    inputs = _inputs(case)
    calls = plan(case["prompt_token"].shape[1], case["token"].shape[1], StreamParams())
    assert len(calls) >= 3 and calls[-1].finalize
    eager = EagerFlow(flow, tiny_config())
    padded = PaddedEstimator(flow.decoder.estimator, extra=50)
    for call in calls:
        tok = case["token"][:, :call.n_tokens]
        ref = eager.chunk(None, inputs, tok, call)
        out = flow_chunk_mel(flow, inputs, tok, call, True, padded)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= PAD_TOL
    assert all(b > n for n, b in padded.frames)  # every call really ran padded


def test_estimator_passthrough_is_used(flow, case):
    calls = []

    def spy(*a):
        calls.append(a[0].shape)
        return flow.decoder.estimator(*a)

    inputs = _inputs(case)
    call = plan(20, 90, StreamParams())[0]
    flow_chunk_mel(flow, inputs, case["token"][:, :call.n_tokens], call, True, spy)
    assert len(calls) == flow.cfg.cfm.n_timesteps and calls[0][0] == 2  # CFG pair in one call per step


# ------------------------------------------------------------------------------------------ bucket policy (CPU)


def test_bucket_frames():
    assert [bucket_frames(n) for n in (1, 49, 50, 51, 100, 101)] == [50, 50, 50, 100, 100, 150]
    assert bucket_frames(7, 4) == 8
    with pytest.raises(ValueError):
        bucket_frames(0)


@pytest.mark.parametrize("prompt", [0, 7, 20, 75, 130])
def test_default_schedule_streaming_calls_need_no_padding(prompt):
    """Upstream's schedule aligns prompt + hop to 25 tokens, so non-final calls land exactly on a bucket."""
    frames = schedule_frames(prompt, 400, StreamParams())
    streaming = [f for f, s in frames if s]
    assert streaming and all(f % 50 == 0 for f in streaming)
    assert [s for _, s in frames][-1] is False  # the final call runs full attention


def test_call_frames_matches_the_encoder_output_length(flow, case):
    inputs = _inputs(case)
    p = case["prompt_token"].shape[1]

    class Seen(Exception):
        pass

    def spy(x, *rest):
        raise Seen(x.shape[-1])  # the first estimator call is enough

    for call in plan(p, case["token"].shape[1], StreamParams()):
        with pytest.raises(Seen) as e:
            flow_chunk_mel(flow, inputs, case["token"][:, :call.n_tokens], call, True, spy)
        assert e.value.args[0] == call_frames(call, p)


def test_profile_from_schedule():
    prof = profile_from_schedule()
    assert prof.min_frames == 2 and prof.max_frames == 3000
    assert prof.min_frames <= prof.opt_frames <= prof.max_frames and prof.opt_frames % 50 == 0
    assert prof.shapes("x") == ((2, 80, 2), (2, 80, prof.opt_frames), (2, 80, 3000))
    assert prof.shapes("mask")[2] == (2, 1, 3000) and prof.shapes("t") == ((2,), (2,), (2,))
    assert prof.shapes("spks")[0] == (2, 80)
    with pytest.raises(ValueError):
        FlowShapeProfile(10, 5, 20)


# ------------------------------------------------------------------------------------------- engine names (CPU)


def test_engine_name_has_every_field_and_parses_back():
    prof = FlowShapeProfile(2, 300, 3000)
    name = engine_name("stream", "ab12cd34", "NVIDIA H100 80GB HBM3", "10.7.0.23", "fp16", prof)
    assert name == "flow_estimator_stream_ab12cd34_nvidia-h100-80gb-hbm3_trt10.7.0.23_fp16_T2-300-3000.plan"
    info = parse_engine_name(Path("engines") / name)
    assert (info.mode, info.fingerprint, info.gpu, info.trt_version, info.dtype) == \
        ("stream", "ab12cd34", "nvidia-h100-80gb-hbm3", "10.7.0.23", "fp16")
    assert info.profile == prof
    assert parse_engine_name("flow_estimator_stream_x.onnx") is None
    with pytest.raises(ValueError):
        engine_name("half", "ab12cd34", "gpu", "10", "fp16", prof)


def _names(*specs):
    return [engine_name(m, fp, g, v, d, FlowShapeProfile(2, 300, mx)) for m, fp, g, v, d, mx in specs]


def test_select_engine_prefers_dtype_then_range():
    names = _names(("stream", "aa", "H100", "10.7", "fp32", 3000), ("stream", "aa", "H100", "10.7", "fp16", 2000),
                   ("stream", "aa", "H100", "10.7", "fp16", 3000), ("full", "aa", "H100", "10.7", "bf16", 3000))
    assert select_engine(names, "stream", "aa", "H100", "10.7", "fp16").path.name == names[2]
    assert select_engine(names, "stream", "aa", "H100", "10.7", "fp32").path.name == names[0]
    assert select_engine(names, "full", "aa", "H100", "10.7", "fp16").dtype == "bf16"


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="stream", fingerprint="bb"), "another model architecture"),
    (dict(mode="stream", gpu="NVIDIA L4"), "another GPU .*nvidia-l4"),
    (dict(mode="stream", trt_version="10.9"), "TensorRT 10.7.*10.9 is installed"),
    (dict(mode="full"), "no TensorRT flow engine for full attention"),
])
def test_select_engine_says_what_differs(kwargs, match):
    names = _names(("stream", "aa", "NVIDIA H100", "10.7", "fp16", 3000))
    args = dict(mode="stream", fingerprint="aa", gpu="NVIDIA H100", trt_version="10.7")
    args.update(kwargs)
    with pytest.raises(BackendUnavailable, match=match) as e:
        select_engine(names, **args)
    assert "build-engines" in str(e.value)


def test_weight_probe_survives_a_cast_but_not_other_weights(flow):
    est = flow.decoder.estimator
    probe = weight_probe(est)
    assert len(probe) > 50
    import copy
    half = copy.deepcopy(est).to(torch.bfloat16)
    assert estimator_fingerprint(half) == estimator_fingerprint(est)
    assert probe_matches(weight_probe(half), probe)
    other = copy.deepcopy(est)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert not probe_matches(weight_probe(other), probe)


# ------------------------------------------------------------------------------------- the stage contract (CPU)


@pytest.mark.parametrize("cls_name", ["CudaGraphFlow", "FusedFlow", "TensorRTFlow"])
def test_gpu_runners_declare_the_whole_stage_contract(cls_name):
    """The engine calls ``chunk``, ``solve``, ``max_batch`` and ``incremental`` on any flow stage without
    probing (:class:`~cosyvoice_fast.flow.stage.FlowStage`); the GPU runners' classes carry all four."""
    from cosyvoice_fast.flow import fused, graph, tensorrt

    cls = {"CudaGraphFlow": graph.CudaGraphFlow, "FusedFlow": fused.FusedFlow,
           "TensorRTFlow": tensorrt.TensorRTFlow}[cls_name]
    assert callable(cls.chunk) and callable(cls.solve)
    assert cls.max_batch >= 1 and cls.incremental is None  # the graph runners set theirs per instance
    assert (cls.max_batch > 1) == (cls is not tensorrt.TensorRTFlow)  # a TensorRT plan takes one request


def test_cpu_runners_keep_the_stage_contract(flow, case):
    """Eager and incremental runners: ``solve`` gives each item its own ``chunk``'s mel, in order; only the
    incremental one keeps flow state (``incremental`` is itself) and it never batches."""
    import types

    from cosyvoice_fast.flow.incremental import IncrementalFlow

    inputs = _inputs(case)
    calls = plan(case["prompt_token"].shape[1], case["token"].shape[1], StreamParams())
    eager, inc = EagerFlow(flow, tiny_config()), IncrementalFlow(flow, tiny_config())
    assert eager.incremental is None and inc.incremental is inc and inc.max_batch == 1
    items = [(types.SimpleNamespace(flow_state=None), inputs, case["token"][:, :c.n_tokens], c) for c in calls[:2]]
    for stage in (eager, inc):
        out = stage.solve(items)
        ref = [eager.chunk(*it) for it in items]
        assert [o.shape for o in out] == [r.shape for r in ref]
        assert max((o - r).abs().max().item() for o, r in zip(out, ref)) <= 1e-4


# ---------------------------------------------------------------------------------- refusals without GPU (CPU)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
@pytest.mark.parametrize("cls", [CudaGraphFlow, TensorRTFlow])
def test_backends_refuse_without_cuda(flow, cls):
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU.*choose 'eager'"):
        cls(flow, tiny_config())


def test_build_stage_set_raises_the_backend_reason(tiny_models):
    if HAS_CUDA:
        pytest.skip("checks the CPU-only refusal")
    from cosyvoice_fast.engine.stages import build_stage_set
    from cosyvoice_fast.config.backends import BackendConfig

    for name in ("cudagraph", "tensorrt"):
        with pytest.raises(BackendUnavailable, match="flow backend"):
            build_stage_set(tiny_models, BackendConfig(flow=name))


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` now raises ImportError


def test_build_without_tensorrt_says_how_to_install(no_tensorrt, tmp_path):
    with pytest.raises(TensorRTNotInstalled, match=r"tensorrt is not installed \(pip install -r "
                                                   r"requirements-trt.txt\)") as e:
        build_flow_engine(tmp_path / "x.onnx", tmp_path / "x.plan", FlowShapeProfile(2, 100, 200))
    assert isinstance(e.value, ImportError) and isinstance(e.value, BackendUnavailable)
    assert TRT_MISSING in str(e.value)
    with pytest.raises(TensorRTNotInstalled):
        build_engines_cli(["--synthetic", "tiny", "--engines-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before exporting anything


def test_cli_reports_missing_tensorrt_as_an_error(no_tensorrt, tmp_path, capsys):
    from cosyvoice_fast.cli.main import main

    assert main(["build-engines", "--synthetic", "tiny", "--engines-dir", str(tmp_path)]) == 2
    assert "tensorrt is not installed" in capsys.readouterr().err


def test_cli_onnx_only_needs_no_tensorrt(no_tensorrt, tmp_path):
    assert build_engines_cli(["--synthetic", "tiny", "--onnx-only", "--engines-dir", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and all(n.endswith("_fp32.onnx") for n in names)
    assert {n.split("_")[2] for n in names} == {"full", "stream"}


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_tensorrt_listed_unavailable_with_reason():
    from cosyvoice_fast.engine.stages import available_backends

    info = {(b.stage, b.name): b for b in available_backends("cpu")}
    assert not info[("flow", "tensorrt")].available and "CUDA" in info[("flow", "tensorrt")].reason


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def flow_cuda(tiny_models):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    import copy

    return copy.deepcopy(tiny_models.flow).cuda().eval()


def _stream_chunks(stage, inputs, case):
    calls = plan(case["prompt_token"].shape[1], case["token"].shape[1], StreamParams())
    return [stage.chunk(None, inputs, case["token"][:, :c.n_tokens], c) for c in calls]


@_gpu
def test_gpu_cudagraph_chunks_equal_eager_fp32(flow_cuda, case):
    inputs = _inputs(case, "cuda")
    ref = _stream_chunks(EagerFlow(flow_cuda, tiny_config()), inputs, case)
    stage = CudaGraphFlow(flow_cuda, tiny_config())
    for _ in range(2):  # second pass replays the graphs captured by the first
        out = _stream_chunks(stage, inputs, case)
        errs = [(a - b).abs().max().item() for a, b in zip(out, ref)]
        assert [a.shape for a in out] == [b.shape for b in ref]
        assert max(errs) <= 1e-4, errs
    assert stage.estimator.eager_calls == 0
    # the encoder ran as graphs too: one capture per (token bucket, attention mode), then replays only
    n_prompt = case["prompt_token"].shape[1]
    enc_keys = {(stage.encoder.bucket(n_prompt + c.n_tokens), not c.finalize)
                for c in plan(n_prompt, case["token"].shape[1], StreamParams())}
    assert stage.encoder.eager_calls == 0 and stage.encoder.captures == len(enc_keys)
    assert stage.encoder.replays == 2 * len(ref)
    # each distinct (bucket, mode) captured once, every Euler step replayed
    buckets = {(bucket_frames(f), s) for f, s in schedule_frames(n_prompt, case["token"].shape[1])}
    assert stage.estimator.captures == len(buckets)
    assert stage.estimator.replays == 2 * len(ref) * flow_cuda.cfg.cfm.n_timesteps


@_gpu
def test_gpu_cudagraph_bf16_stays_close(tiny_models, case):
    import copy

    flow16 = copy.deepcopy(tiny_models.flow).cuda().to(torch.bfloat16).eval()
    inputs = _inputs(case, "cuda", torch.bfloat16)
    ref = _stream_chunks(EagerFlow(flow16, tiny_config()), inputs, case)
    out = _stream_chunks(CudaGraphFlow(flow16, tiny_config()), inputs, case)
    for a, b in zip(out, ref):
        assert torch.isfinite(a).all()
        scale = max(1.0, b.abs().max().item())
        # bf16 has ~3 significant digits; padding changes kernel shapes on the final chunk (not measured on
        # this machine: the bound is deliberately loose, a real error is O(1))
        assert (a - b).abs().max().item() <= 5e-2 * scale
        assert (a - b).abs().mean().item() <= 1e-2 * scale


@_gpu
def test_gpu_graph_estimator_pads_and_falls_back(flow_cuda):
    stage = CudaGraphFlow(flow_cuda, tiny_config(), max_frames=200)
    est = flow_cuda.decoder.estimator
    for frames, streaming in ((73, True), (73, False), (150, True), (260, True)):
        args = example_inputs(frames, device="cuda", seed=frames)
        with torch.inference_mode():
            ref = est(*args, streaming)
        out = stage.estimator(*args, streaming)
        assert out.shape == ref.shape and (out - ref).abs().max().item() <= 1e-4
    assert stage.estimator.eager_calls == 1  # 260 > max_frames
    assert stage.warmup(prompt_tokens=(20,), total_tokens=90)


# ------------------------------------------------------------------ graph runner bookkeeping (CPU, fake graphs)


def test_graph_estimator_pads_slices_and_keys_by_bucket(flow, fake_graphs):
    from cosyvoice_fast.flow.graph import GraphEstimator

    est = flow.decoder.estimator
    runner = GraphEstimator(est, torch.device("cpu"), granularity=50, max_frames=150)
    # long first so that shorter calls reuse a buffer with stale real data in their padded tail
    for frames, streaming in ((140, True), (120, True), (101, True), (60, False), (37, True), (200, True)):
        args = example_inputs(frames, seed=frames)
        with torch.inference_mode():
            ref = est(*args, streaming)
            out = runner(*args, streaming)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= PAD_TOL, frames
    assert runner.captures == 3  # (150, stream), (100, full), (50, stream); 200 > max_frames ran eagerly
    assert runner.replays == 5 and runner.eager_calls == 1
