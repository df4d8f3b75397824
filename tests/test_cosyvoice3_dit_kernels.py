"""CosyVoice3's ``cudagraph`` DiT path (:class:`~cosyvoice_fast.flow.kernels.dit_blas.BlasDiT`) and its Triton
glue kernels (modulated LayerNorm with the gated residual, causal grouped conv + Mish) against PyTorch and the
eager DiT.  CPU runs the kernels through Triton's interpreter; its bf16 ``tl.dot`` is broken, so the conv's
16-bit CPU case is fp16 and the bf16 cases of the dot kernels are GPU tests (``-m gpu``)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.dit import dit_flow_config_from_doc
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml
from cosyvoice_fast.flow.kernels.dit_blas import BlasDiT, linear_gelu
from cosyvoice_fast.flow.kernels.dit_conv import (
    causal_conv_mish, groups_per_program, pack_conv_weight, position_embedding_reference,
)
from cosyvoice_fast.flow.kernels.dit_norm import modulated_norm, modulated_norm_reference
from cosyvoice_fast.flow.model.dit_flow import DiTFlow, load_dit_flow

FP32_TOL = 1e-5  # one kernel or the whole DiT against eager fp32 on the same inputs
RECORDED_TOL = 1e-4  # against the fixture's recorded upstream outputs (its README)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def cv3_flow(fixture3_dir) -> DiTFlow:
    cfg = dit_flow_config_from_doc(read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml"), "cosyvoice3.yaml")
    return load_dit_flow(cfg, torch.load(fixture3_dir / "flow.pt", weights_only=True))


@pytest.fixture
def dit(cv3_flow, no_tf32):
    return copy.deepcopy(cv3_flow.decoder.estimator).to(DEV).eval()


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def _est_inputs(case: dict, frames: int | None = None) -> dict:
    e = case["estimator_inputs"]
    return {k: (v[..., :frames] if frames and k in ("x", "mask", "mu", "cond") else v).to(DEV) for k, v in e.items()}


def _run(module, e: dict, streaming: bool, **kw) -> torch.Tensor:
    with torch.inference_mode():
        return module(e["x"], e["mask"], e["mu"], e["t"], e["spks"], e["cond"], streaming, **kw)


# ------------------------------------------------------------------------------------------ kernels


def _norm_shapes(cv3_flow) -> list[tuple[int, int, int]]:
    """(batch rows, frames, channels): odd small shapes and the fixture DiT's width."""
    return [(2, 7, 48), (3, 5, 64), (2, 13, cv3_flow.cfg.dit.dim)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, 2 ** -7)])
def test_cosyvoice3_dit_modulated_norm_matches_torch(cv3_flow, dtype, tol):
    g = torch.Generator().manual_seed(0)
    for b, t, d in _norm_shapes(cv3_flow):
        x = torch.randn(b * t, d, generator=g).to(DEV, dtype)
        y = torch.randn(b * t, d, generator=g).to(DEV, dtype)
        for rows, sel in ((1, None), (b, None), (4, torch.tensor([[2.0]]))):
            mods = (0.5 * torch.randn(rows, 6 * d, generator=g)).to(DEV, dtype)
            sel = sel.to(DEV, dtype) if sel is not None else None
            # attention-side norm (no residual), then the gated residual + MLP-side norm
            h_ref, _ = modulated_norm_reference(x, mods, 0, d, t, sel=sel)
            h = modulated_norm(x.clone(), mods, 0, d, t, sel=sel)
            assert _maxabs(h, h_ref) <= tol * max(1.0, h_ref.float().abs().max().item())
            h_ref, x_ref = modulated_norm_reference(x, mods, 3 * d, 4 * d, t, y=y, gate=2 * d, sel=sel)
            xx = x.clone()
            h = modulated_norm(xx, mods, 3 * d, 4 * d, t, y=y, gate=2 * d, sel=sel)
            assert _maxabs(xx, x_ref) <= tol * max(1.0, x_ref.float().abs().max().item())
            assert _maxabs(h, h_ref) <= tol * max(1.0, h_ref.float().abs().max().item())


def test_cosyvoice3_dit_modulated_norm_refuses_bad_shapes():
    x = torch.zeros(10, 16, device=DEV)
    with pytest.raises(ValueError, match="10 rows do not split into batch rows of 3 frames"):
        modulated_norm(x, torch.zeros(1, 96, device=DEV), 0, 16, 3)
    with pytest.raises(ValueError, match="3 modulation rows for 2 batch rows of 5 frames"):
        modulated_norm(x, torch.zeros(3, 96, device=DEV), 0, 16, 5)
    with pytest.raises(ValueError, match="scale columns 90..106 outside the 96 of mods"):
        modulated_norm(x, torch.zeros(1, 96, device=DEV), 0, 90, 5)


def test_cosyvoice3_dit_conv_packing_is_block_diagonal(cv3_flow):
    conv = cv3_flow.decoder.estimator.input_embed.conv_pos_embed.conv1[0]
    c, groups, ks = conv.in_channels, conv.groups, conv.kernel_size[0]
    n = groups_per_program(c, groups)
    cg = c // groups
    assert groups % n == 0 and (n * cg <= 64 or n == 1)
    w = pack_conv_weight(conv.weight.detach(), groups)
    assert w.shape == (groups // n, ks, n * cg, n * cg)
    for grp in range(groups):  # every group's block sits on its program's diagonal; the rest is zero
        p, j = divmod(grp, n)
        blk = w[p, :, j * cg:(j + 1) * cg, j * cg:(j + 1) * cg]
        assert torch.equal(blk, conv.weight.detach()[grp * cg:(grp + 1) * cg].permute(2, 1, 0))
    assert int((w != 0).sum()) == int((conv.weight != 0).sum())
    assert groups_per_program(1024, 16) == 1  # the real model: one 64-channel group per program


def _conv_cases(cv3_flow) -> list[tuple[int, int, int, int, int]]:
    """(batch rows, frames, channels, groups, kernel): small ones and the fixture's position convs."""
    conv = cv3_flow.decoder.estimator.input_embed.conv_pos_embed.conv1[0]
    return [(2, 9, 64, 16, 5), (1, 70, 128, 2, 7), (2, 37, conv.in_channels, conv.groups, conv.kernel_size[0])]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.float16, 2e-3)])
def test_cosyvoice3_dit_causal_conv_matches_torch(cv3_flow, dtype, tol):
    torch.manual_seed(0)
    for b, t, c, groups, ks in _conv_cases(cv3_flow):
        c1, c2 = (torch.nn.Conv1d(c, c, ks, groups=groups).to(DEV) for _ in range(2))
        x = torch.randn(b * t, c, device=DEV)
        with torch.no_grad():
            ref = position_embedding_reference(x, c1, c2, t)
            xd = x.to(dtype)
            w1, w2 = (pack_conv_weight(m.weight.to(dtype), groups) for m in (c1, c2))
            y1 = causal_conv_mish(xd, w1, c1.bias.to(dtype), t)
            out = causal_conv_mish(y1, w2, c2.bias.to(dtype), t, residual=xd)
        assert _maxabs(out, ref) <= tol * max(1.0, ref.abs().max().item()), (b, t, c, groups, ks)
        # causal: changing the last frame of a row changes nothing before it
        x2 = x.clone().view(b, t, c)
        x2[:, -1] += 1.0
        with torch.no_grad():
            y2 = causal_conv_mish(causal_conv_mish(x2.view(b * t, c).to(dtype), w1, c1.bias.to(dtype), t), w2,
                                  c2.bias.to(dtype), t, residual=x2.view(b * t, c).to(dtype))
        assert torch.equal(y2.view(b, t, c)[:, :-1], out.view(b, t, c)[:, :-1])


# ------------------------------------------------------------------------------------------ the whole DiT


@pytest.mark.parametrize("streaming,key", [(False, "estimator_output"), (True, "estimator_output_streaming")])
def test_cosyvoice3_blas_dit_matches_eager_and_recorded(dit, load_case3, streaming, key):
    case = load_case3("case_flow")
    e = _est_inputs(case)
    out, ref = _run(BlasDiT(dit), e, streaming), _run(dit, e, streaming)
    assert _maxabs(out, ref) <= FP32_TOL
    assert _maxabs(out, case[key]) <= RECORDED_TOL


def test_cosyvoice3_blas_dit_per_row_times(dit, load_case3):
    """Rows at different flow times read their own modulation rows (the eager DiT allows it)."""
    e = _est_inputs(load_case3("case_flow"), dit.cfg.static_chunk_size)
    b = e["x"].shape[0]
    e["t"] = torch.linspace(0.1, 0.9, b, device=DEV)
    assert _maxabs(_run(BlasDiT(dit), e, True), _run(dit, e, True)) <= FP32_TOL
    e["t"] = e["t"][:1].reshape(())  # one 0-dim time for every row
    assert _maxabs(_run(BlasDiT(dit), e, False), _run(dit, e, False)) <= FP32_TOL


def test_cosyvoice3_blas_dit_padding_never_reaches_real_frames(dit, load_case3):
    """A graph bucket's shape: one real row right-padded by 10 frames, then an all-padding row (mask 0)."""
    e = _est_inputs(load_case3("case_flow"))
    n = e["x"].shape[2]

    def pad(z: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.pad(z[:1], (0, 10))
        return torch.cat([z, torch.zeros_like(z)])

    one = {k: v[:1] for k, v in e.items()}
    padded = {"x": pad(e["x"]), "mask": pad(e["mask"]), "mu": pad(e["mu"]), "t": e["t"][:1].expand(2),
              "spks": torch.cat([e["spks"][:1], e["spks"][:1] * 0]), "cond": pad(e["cond"])}
    out = _run(BlasDiT(dit), padded, True)
    assert torch.isfinite(out).all()
    assert _maxabs(out[:1, :, :n], _run(dit, one, True)) <= FP32_TOL


def test_cosyvoice3_blas_dit_modulation_table(dit, load_case3, cv3_flow):
    """Step graphs read each Euler step's modulations from a table filled once: bit-identical to computing them
    from the time; another schedule is refused (captured graphs read the one table)."""
    from cosyvoice_fast.flow.model.cfm import euler_schedule

    e = _est_inputs(load_case3("case_flow"), dit.cfg.static_chunk_size // 2)
    steps = cv3_flow.cfg.cfm.n_timesteps
    ts, _ = euler_schedule(steps, cv3_flow.cfg.cfm.t_scheduler, DEV)
    blas = BlasDiT(dit, steps)
    assert blas.time_width() == 1
    with torch.inference_mode():
        table = blas.time_table(ts, 2)
    assert table.shape == (steps, 2, 1)
    i = steps // 2
    by_table = _run(blas, dict(e, t=ts[:1].expand(2)), True, tall=table[i])
    by_time = _run(blas, dict(e, t=ts[i:i + 1].expand(2)), True)
    assert torch.equal(by_table, by_time)
    with torch.inference_mode():
        blas.time_table(ts, 4)  # the same schedule again (another row bucket): fine
        with pytest.raises(ValueError, match="one Euler schedule per module"):
            blas.time_table(ts.flip(0), 2)


def test_cosyvoice3_graph_stage_captures_blas_dit(cv3_flow, load_case3, fake_graphs, monkeypatch):
    """The ``cudagraph`` stage's graphs run BlasDiT (not the eager modules): one streamed call through the
    replayed step graphs equals the eager stage's call (CPU: graphs replayed eagerly, kernels interpreted)."""
    from cosyvoice_fast.config.schedule import ChunkCursor
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.flow import dit_graph
    from cosyvoice_fast.flow.dit_eager import DiTEagerFlow
    from cosyvoice_fast.frontend.request import ModelInputs

    monkeypatch.setattr(dit_graph, "why_unavailable", lambda flow, backend: None)
    flow = copy.deepcopy(cv3_flow).to(DEV).eval()
    stage = dit_graph.DiTGraphFlow(flow, None)
    assert isinstance(stage.estimator.estimator, BlasDiT)
    case = load_case3("case_flow_stream")
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])], flow_prompt_speech_token=case["prompt_token"],
                         prompt_feat=case["prompt_feat"], embedding=case["embedding"]).to(DEV, torch.float32)
    cursor = ChunkCursor(case["prompt_token"].shape[1], StreamParams(), flow.cfg.chunk_tokens)
    call = cursor.next_call(case["token"].shape[1], llm_done=True)  # the first call: streaming attention
    tokens = case["token"][:, :call.n_tokens]
    with torch.inference_mode():
        mel = stage.chunk(None, inputs, tokens, call)
        ref = DiTEagerFlow(flow).chunk(None, inputs, tokens, call)
    assert _maxabs(mel, ref) <= RECORDED_TOL
    assert stage.estimator.eager_calls == 0 and stage.estimator.replays == flow.cfg.cfm.n_timesteps


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_gpu_cosyvoice3_dit_linear_gelu_is_tanh_form():
    """``linear_gelu`` is the DiT MLP's tanh GELU (eager: ``GELU(approximate="tanh")``) in fp32 and bf16, and the
    cuBLASLt epilogue it uses for 16-bit rows is that form, not erf."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        # pre-activations of O(1), where the tanh and erf forms differ by up to ~5e-4
        x, w, b = (torch.randn(*s, generator=g).to("cuda", dtype) for s in ((224, 1024), (2048, 1024), (2048,)))
        x = x / 32
        pre = x.float() @ w.float().t() + b.float()
        ref = torch.nn.functional.gelu(pre, approximate="tanh")
        got = linear_gelu(x, w, b).float()
        bound = tol * ref.abs().max().item()
        assert _maxabs(got, ref) <= bound
        if dtype == torch.float32:  # the epilogue bf16 rows use is the tanh form: in fp32 the check tells them apart
            epilogue = torch._addmm_activation(b, x, w.t(), use_gelu=True)
            assert _maxabs(epilogue, ref) <= bound
            assert _maxabs(torch.nn.functional.gelu(pre), ref) > 3 * bound


@pytest.mark.gpu
def test_gpu_cosyvoice3_dit_causal_conv_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    for b, t, c, groups, ks in ((2, 112, 1024, 16, 31), (32, 112, 1024, 16, 31), (2, 37, 64, 16, 31)):
        c1, c2 = (torch.nn.Conv1d(c, c, ks, groups=groups).cuda() for _ in range(2))
        x = torch.randn(b * t, c, device="cuda")
        with torch.no_grad():
            ref = position_embedding_reference(x, c1, c2, t)
            xd = x.bfloat16()
            w1, w2 = (pack_conv_weight(m.weight.bfloat16(), groups) for m in (c1, c2))
            out = causal_conv_mish(causal_conv_mish(xd, w1, c1.bias.bfloat16(), t), w2, c2.bias.bfloat16(), t,
                                   residual=xd)
        assert _maxabs(out, ref) <= 2e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.gpu
def test_gpu_cosyvoice3_blas_dit_full_size_bf16_close_to_fp32():
    """The real sizes (dim 1024, 22 blocks) with random weights: BlasDiT in bf16 is no further from the eager DiT
    in fp32 than the eager DiT's own bf16 run (within 2x, max and mean; a defect is O(1) off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import math

    from cosyvoice_fast.config.dit import DiTConfig
    from cosyvoice_fast.flow.model.dit import DiT

    torch.manual_seed(0)
    est = DiT(DiTConfig()).cuda().eval()
    with torch.no_grad():
        for p in est.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
    c = est.cfg
    for rows, streaming in ((2, False), (2, True), (8, True)):
        e = {"x": torch.randn(rows, c.mel_dim, 112), "mask": torch.ones(rows, 1, 112),
             "mu": torch.randn(rows, c.mu_dim, 112), "t": torch.full((rows,), 0.3),
             "spks": torch.randn(rows, c.spk_dim), "cond": torch.randn(rows, c.mel_dim, 112)}
        ref = _run(est, {k: v.cuda() for k, v in e.items()}, streaming)
        est16 = copy.deepcopy(est).bfloat16()
        e16 = {k: v.cuda().bfloat16() for k, v in e.items()}
        out, eager16 = _run(BlasDiT(est16), e16, streaming), _run(est16, e16, streaming)
        assert torch.isfinite(out).all()
        floor = 1e-3 * max(1.0, ref.abs().max().item())

        def mean_err(a: torch.Tensor) -> float:
            return (a.float() - ref.float()).abs().mean().item()

        assert _maxabs(out, ref) <= 2 * _maxabs(eager16, ref) + floor, (rows, streaming)
        assert mean_err(out) <= 2 * mean_err(eager16) + floor, (rows, streaming)
