"""The fused estimator (``kernels/estimator_fused.py``) and the ``fused`` flow backend.

CPU (Triton interpreter, tiny sizes): chunk-causal and full attention, batched rows with right padding and
an all-padding row, the graph runner's length/row buckets, the cuBLAS path's LayerNorms folded into its
epilogues.  GPU (marked ``gpu``; full CosyVoice2 sizes with seeded random weights, no fixture files): fp32
within 1e-4 of eager, bf16 no worse than eager bf16 (both against eager fp32), padding exact, and the
``fused`` flow stage equal to eager over a streamed schedule.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.model import DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.flow.kernels.tuning import default_tuning  # noqa: E402
from cosyvoice_fast.bench.estimator_profile import estimator_inputs  # noqa: E402
from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder  # noqa: E402

TOL = 1e-4
PAD_TOL = 1e-5


@pytest.fixture(scope="module")
def small():
    """A tinier estimator than the fixture's (one mid block, chunk 20) so that the interpreter is quick."""
    torch.manual_seed(0)
    cfg = DecoderConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2,
                        static_chunk_size=20)
    return CausalConditionalDecoder(cfg).eval()


@pytest.mark.parametrize("streaming,options", [(True, {}), (False, {"resnet_split_ln": False}),
                                               (True, {"resnet_split_ln": True})])
def test_fused_equals_eager_on_padded_batched_rows(small, streaming, options):
    """Two requests' CFG rows (4 rows) of different lengths plus an all-padding row: every real frame equals
    eager, padded frames and the empty row are exactly 0, and a row equals its own unpadded run."""
    valid = [30, 17, 0, 30]
    args = estimator_inputs(small.cfg, len(valid), 30, torch.float32, "cpu", valid=valid,
                            seed=int(torch.randint(0, 10**6, (1,))))
    fused = FusedEstimator(small, **options)
    with torch.no_grad():
        out, ref = fused(*args, streaming), small(*args, streaming)
        alone = fused(*(z[1:2, ..., :17] if z.dim() == 3 else z[1:2] for z in args), streaming)
    assert (out - ref).abs().max().item() <= TOL
    assert not out[2].any() and not out[1, :, 17:].any()
    assert (out[1:2, :, :17] - alone).abs().max().item() <= PAD_TOL


def test_fused_estimator_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="one U-Net level"):
        FusedEstimator(CausalConditionalDecoder(DecoderConfig(channels=(32, 32), attention_head_dim=16,
                                                              n_blocks=1, num_mid_blocks=1, num_heads=2)))


@pytest.mark.parametrize("head_dim,streaming", [(24, True), (40, False)])
def test_any_attention_head_size_equals_eager(head_dim, streaming):
    """A head size that is not a power of two (CosyVoice3's 24, or 40): the attention kernels pad it to the
    next power of two with masked lanes; padded batched rows equal eager within the usual tolerance."""
    torch.manual_seed(head_dim)
    est = CausalConditionalDecoder(DecoderConfig(channels=(32,), attention_head_dim=head_dim, n_blocks=1,
                                                 num_mid_blocks=1, num_heads=2, static_chunk_size=20)).eval()
    valid = [30, 17]
    args = estimator_inputs(est.cfg, len(valid), 30, torch.float32, "cpu", valid=valid, seed=head_dim)
    with torch.no_grad():
        out, ref = FusedEstimator(est)(*args, streaming), est(*args, streaming)
    assert (out - ref).abs().max().item() <= TOL
    assert not out[1, :, 17:].any()


def test_fused_weights_follow_the_module(small):
    """Packed weights are re-made when the module's parameters change (a reload / ``.to()``)."""
    import copy

    est = copy.deepcopy(small)
    fused = FusedEstimator(est)
    args = estimator_inputs(est.cfg, 2, 20, torch.float32, "cpu", seed=3)
    with torch.no_grad():
        fused(*args, True)
        conv = est.down_blocks[0][0].block1.block[0]
        conv.weight = torch.nn.Parameter(conv.weight * 1.5)
        assert (fused(*args, True) - est(*args, True)).abs().max().item() <= TOL
        est.fuse_projections()  # what the graph backends do: q/k/v become views of one buffer, reused as is
        attn = est.mid_blocks[0][1][0].attn1
        attn.to_k.weight.mul_(0.5)
        assert (fused(*args, True) - est(*args, True)).abs().max().item() <= TOL
        assert fused.packed()["qkv"][id(attn)] is attn.qkv_weight


def test_graph_runner_captures_the_fused_estimator(small, fake_graphs):
    """The ``cudagraph`` flow's runner (length and row buckets, static buffers) drives the fused estimator."""
    from cosyvoice_fast.flow.graph import GraphEstimator

    runner = GraphEstimator(FusedEstimator(small), torch.device("cpu"), granularity=20, max_frames=60)
    for rows, frames in ((3, 37), (2, 13), (1, 22)):  # buckets 40 x 4 (a padding row), 20 x 2, then 40 x 2
        args = estimator_inputs(small.cfg, rows, frames, torch.float32, "cpu", seed=frames)
        with torch.no_grad():
            ref = small(*args, True)
        out = runner(*args, True)
        assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL
        with torch.inference_mode():  # what the next replay leaves alone may be anything
            for g in runner.caches[True].graphs.values():
                for buf in g.inputs[:6]:
                    buf.fill_(float("nan"))
    assert runner.captures == 3 and runner.eager_calls == 0


@pytest.fixture(scope="module")
def two_blocks():
    """Two transformer blocks per group (so a block's last GEMM can hand the next block its ``norm1``) and a
    channel count that is not a power of two; fp32 and fp16 copies (fp16, not bf16: the Triton interpreter's
    bf16 dots return garbage, its fp16 dots are right)."""
    import copy

    torch.manual_seed(0)
    cfg = DecoderConfig(channels=(48,), attention_head_dim=16, n_blocks=2, num_mid_blocks=1, num_heads=2,
                        static_chunk_size=20)
    est = CausalConditionalDecoder(cfg).eval()
    return est, copy.deepcopy(est).to(torch.float16)


def _transformer_groups(est: CausalConditionalDecoder) -> list:
    return [est.down_blocks[0][1], *(tb for _, tb in est.mid_blocks), est.up_blocks[0][1]]


# F.layer_norm passes per forward on the many-rows path, (with the fold, without), from the block count and the
# number of transformer groups
def test_many_rows_fold_the_next_layer_norm_into_the_epilogue(two_blocks, monkeypatch):
    """With the many-rows path forced (``many_rows_m`` = 8 rows; cuBLAS or tall Triton per GEMM), each
    residual-producing GEMM's epilogue writes the next LayerNorm, so ``F.layer_norm`` runs once per transformer
    group (its first ``norm1``) instead of twice per block.  The result is within the fp16 bounds: against eager
    fp32, no worse than 1.5x eager fp16 or the all-Triton path, and the fusion itself moves it by no more than
    eager fp16's own error; padding stays exactly 0."""
    from cosyvoice_fast.flow.kernels import estimator_fused

    est32, est16 = two_blocks
    groups = [g for g in _transformer_groups(est16) if len(g)]
    expect = (len(groups), 2 * sum(len(g) for g in groups))
    args = estimator_inputs(est32.cfg, 2, 24, torch.float32, "cpu", valid=[24, 13], seed=11)
    a16 = tuple(z.to(torch.float16) for z in args)
    calls = []
    layer_norm = torch.nn.functional.layer_norm

    def counted(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return layer_norm(*a, **kw)

    def run(cublas_m: int, fold: bool = True) -> tuple[torch.Tensor, int]:
        with monkeypatch.context() as mp:
            mp.setattr(torch.nn.functional, "layer_norm", counted)
            if not fold:  # the transformer blocks as before the fusion: linear still takes the many-rows path
                mp.setattr(estimator_fused, "use_many_rows", lambda *_: False)
            calls.clear()
            with torch.no_grad():
                out = FusedEstimator(est16, tuning=replace(default_tuning(), many_rows_m=cublas_m))(*a16, True)
            return out.float(), len(calls)

    with torch.no_grad():
        ref = est32(*args, True)
        e_eager = (est16(*a16, True).float() - ref).abs()
    triton_out, n_triton = run(1 << 40)
    folded, n_folded = run(8)
    unfolded, n_unfolded = run(8, fold=False)
    assert (n_folded - n_triton, n_unfolded - n_triton) == expect
    e_triton, e_folded = (triton_out - ref).abs(), (folded - ref).abs()
    assert e_folded.max().item() <= 1.5 * max(e_eager.max().item(), e_triton.max().item())
    assert e_folded.mean().item() <= 1.5 * max(e_eager.mean().item(), e_triton.mean().item())
    assert (folded - unfolded).abs().max().item() <= e_eager.max().item()
    assert not folded[1, :, 13:].any()


def test_kernel_count_formula():
    from cosyvoice_fast.bench.estimator_profile import kernels_per_forward

    assert kernels_per_forward(4, 12) == 316  # CosyVoice2: 14 ResNet blocks, 56 transformer blocks
    assert kernels_per_forward(4, 12, resnet_split_ln=True) == 344


# -------------------------------------------------------------------------------------- GPU, full size

_gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def full():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    est32 = CausalConditionalDecoder(DecoderConfig()).cuda().eval()
    import copy

    return est32, copy.deepcopy(est32).to(torch.bfloat16)


@_gpu
@pytest.mark.parametrize("frames", [56, 206])
@pytest.mark.parametrize("streaming", [True, False])
def test_gpu_full_size_fp32_and_bf16(full, no_tf32, frames, streaming):
    est32, est16 = full
    args = estimator_inputs(est32.cfg, 2, frames, torch.float32, seed=frames)
    a16 = tuple(z.to(torch.bfloat16) for z in args)
    with torch.inference_mode():
        ref = est32(*args, streaming)
        assert (FusedEstimator(est32)(*args, streaming) - ref).abs().max().item() <= TOL
        e_eager = (est16(*a16, streaming).float() - ref).abs()
        e_fused = (FusedEstimator(est16)(*a16, streaming).float() - ref).abs()
    # bf16: the fused kernels keep fp32 accumulators and round less often than eager, so no worse than it
    assert e_fused.max().item() <= 1.5 * e_eager.max().item()
    assert e_fused.mean().item() <= 1.5 * e_eager.mean().item()


@_gpu
def test_gpu_estimator_profile_counts_the_step_graphs_kernels(full):
    """profile_stages' estimator lines: the fused forward with its time-table row launches the kernels
    ``kernels_per_forward`` counts less the three time-embedding GEMMs, and without the row exactly that count;
    the FLOPs are the model's, every time is a real measurement."""
    from cosyvoice_fast.bench.estimator_profile import estimator_flops, estimator_profile, kernels_per_forward

    est16 = full[1]
    cfg, frames = est16.cfg, 56
    expect = kernels_per_forward(cfg.n_blocks, cfg.num_mid_blocks,
                                 resnet_split_ln=2 * frames <= default_tuning().split_ln_max_rows)
    for time_row, kernels in ((True, expect - 3), (False, expect)):
        eager, fused = estimator_profile(est16, frames=(frames,), iters=3, time_row=time_row)
        assert (eager.backend, fused.backend) == ("cudagraph", "fused")
        assert fused.kernels == kernels
        assert eager.kernels > fused.kernels
        for p in (eager, fused):
            assert p.gflop == round(estimator_flops(cfg, 2, frames, True) / 1e9, 2)
            assert p.graph_ms > 0 and p.kernel_ms > 0
            assert 0 < sum(p.by_kernel_us.values()) <= p.kernel_ms * 1e3 + 0.5
            assert p.as_dict()["tflops"] == round(p.gflop / p.graph_ms, 2)


@_gpu
@pytest.mark.parametrize("frames,streaming", [(200, True), (450, False)])
def test_gpu_full_size_bf16_solve_mel_is_no_worse_than_eager_bf16(full, no_tf32, frames, streaming):
    """The whole guided solve (10 Euler steps, CFG) at the bench's first (chunk mask) and final (full attention)
    chunk lengths: the fused bf16 mel's max, p99.9 and mean error against eager fp32 stay within 1.5 x eager
    bf16's (BENCHMARKS.md tabulates the values; benchmarks/bf16_error.py measures them through the stages)."""
    from cosyvoice_fast.config.model import CFMConfig
    from cosyvoice_fast.flow.model.cfm import CausalCFM

    est32, est16 = full
    cfm32 = CausalCFM(CFMConfig(), est32.cfg).cuda().eval()
    cfm32.estimator = est32
    cfm16 = CausalCFM(CFMConfig(), est16.cfg).cuda().eval().to(torch.bfloat16)
    cfm16.estimator = est16
    g = torch.Generator().manual_seed(frames)
    mu = torch.randn(1, 80, frames, generator=g).cuda()
    spks = torch.randn(1, 80, generator=g).cuda()
    cond = torch.zeros(1, 80, frames, device="cuda")
    cond[:, :, :150] = torch.randn(1, 80, 150, generator=g).cuda() - 5
    mask = torch.ones(1, 1, frames, device="cuda")
    b16 = [z.to(torch.bfloat16) for z in (mu, mask, spks, cond)]
    with torch.inference_mode():
        ref = cfm32.solve_batch(mu, mask, spks, cond, streaming=streaming)
        e_eager = (cfm16.solve_batch(*b16, streaming=streaming) - ref).abs().flatten()
        e_fused = (cfm16.solve_batch(*b16, streaming=streaming, estimator=FusedEstimator(est16)) - ref).abs()
    e_fused = e_fused.flatten()
    k = int(0.999 * e_fused.numel())
    assert torch.isfinite(e_fused).all()
    for stat in (lambda e: e.max(), lambda e: e.kthvalue(k).values, lambda e: e.mean()):
        assert stat(e_fused).item() <= 1.5 * stat(e_eager).item()


@_gpu
@pytest.mark.parametrize("options", [{"resnet_split_ln": True}, {"resnet_split_ln": False}])
def test_gpu_full_size_fp32_kernel_options(full, no_tf32, options):
    est32, _ = full
    args = estimator_inputs(est32.cfg, 2, 206, torch.float32, seed=7)
    with torch.inference_mode():
        for streaming in (True, False):
            ref = est32(*args, streaming)
            assert (FusedEstimator(est32, **options)(*args, streaming) - ref).abs().max().item() <= TOL


@_gpu
def test_gpu_full_size_many_rows_path_within_the_bf16_bounds(full, no_tf32):
    """A batched solve (16 requests: 32 rows of 206 frames) runs its GEMMs on the many-rows path (cuBLAS with
    Triton epilogues, the tall Triton kernels, or each where it is faster); its error against fp32 is no worse
    than the row-tiled path's or eager bf16's (same bound as one CFG pair)."""
    from cosyvoice_fast.flow.kernels import estimator_cublas

    est32, est16 = full
    args = estimator_inputs(est32.cfg, 32, 206, torch.float32, seed=5)
    a16 = tuple(z.to(torch.bfloat16) for z in args)
    assert estimator_cublas.use_many_rows(32 * 206, est16.final_proj.weight, 0, default_tuning())
    def pairs(est, xs):  # eager references one CFG pair at a time: rows are independent, and eager fp32 at 32
        # rows with TF32 off reserved 73 GB on the H100 (convolution workspaces), starving later tests
        return torch.cat([est(*(z[r:r + 2] for z in xs), True) for r in range(0, 32, 2)])

    with torch.inference_mode():
        ref = pairs(est32, args)
        e_eager = (pairs(est16, a16).float() - ref).abs()
        e_many = (FusedEstimator(est16)(*a16, True).float() - ref).abs()
        all_triton = replace(default_tuning(), many_rows_m=1 << 40)
        e_triton = (FusedEstimator(est16, tuning=all_triton)(*a16, True).float() - ref).abs()
    assert e_many.max().item() <= 1.5 * max(e_eager.max().item(), e_triton.max().item())
    assert e_many.mean().item() <= 1.5 * max(e_eager.mean().item(), e_triton.mean().item())


@_gpu
def test_gpu_pdl_and_early_weight_tiles_change_no_bit(full):
    """Programmatic dependent launch only moves when a kernel's programs start, and an early weight tile only
    when a load is issued: CUDA-graph replays of the full-size bf16 forward with both off, PDL alone, and both
    on give identical bits, replay after replay (a read before a kernel's wait would show up here as a race)."""
    _, est16 = full
    args = estimator_inputs(est16.cfg, 2, 206, torch.bfloat16, seed=3)
    results = []
    for pdl, early in ((False, False), (True, False), (True, True)):
        fused = FusedEstimator(est16, tuning=replace(default_tuning(), pdl=pdl, early_weights=early))
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fused(*args, True)  # compile and pack outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused(*args, True)
            for _ in range(3):
                graph.replay()
                results.append(out.clone())
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert torch.isfinite(results[0]).all()


@_gpu
@pytest.mark.parametrize("path", ["row_tiled", "oneshot", "many_rows"])
def test_gpu_full_size_padding_is_exact(full, path):
    """Padded rows and frames change no real frame: a row of a padded 4-row batch equals the same row run alone,
    on the same GEMM path and tiles for both calls (the row-tiled kernels, the one-shot GEMMs with their few-rows
    tiles, or the many-rows path from one row on, cuBLAS or tall Triton kernels per GEMM; the default switches
    paths and tiles by row count, so there the two calls would differ by bf16 rounding, which the bf16 bound
    tests cover)."""
    # the padded batch takes the one-shot GEMMs too, not only the lone rows, with the few-rows tiles for both
    # and no pair tiles for the lone rows
    tuning = replace(default_tuning(), many_rows_m=1 if path == "many_rows" else 1 << 40, oneshot=path == "oneshot",
                     oneshot_max_rows=1 << 40, few_rows=1 << 40, pair_rows=(1, 0))
    est32, est16 = full
    valid = [206, 131, 0, 77]
    for est, tol in ((est32, PAD_TOL), (est16, 1e-2)):
        fused = FusedEstimator(est, tuning=tuning)
        args = estimator_inputs(est.cfg, 4, 206, next(est.parameters()).dtype, valid=valid, seed=1)
        with torch.inference_mode():
            out = fused(*args, True)
            assert torch.isfinite(out).all() and not out[2].any()
            for row, n in ((1, 131), (3, 77)):
                alone = fused(*(z[row:row + 1, ..., :n] if z.dim() == 3 else z[row:row + 1] for z in args), True)
                assert (out[row:row + 1, :, :n] - alone).float().abs().max().item() <= tol
                assert not out[row, :, n:].any()


@_gpu
def test_gpu_fused_flow_stage_equals_eager(no_tf32):
    """The ``fused`` flow stage over a streamed schedule (graph replays) equals the eager stage in fp32."""
    from cosyvoice_fast.flow.eager import EagerFlow
    from cosyvoice_fast.flow.fused import FusedFlow
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.config.model import tiny_config
    from cosyvoice_fast.modeldir.files import build_modules
    from cosyvoice_fast.frontend.request import ModelInputs
    from cosyvoice_fast.config.schedule import plan

    cfg = tiny_config()
    torch.manual_seed(0)
    flow = build_modules(cfg)[1].cuda().eval()
    n_prompt, n_tokens = 20, 90
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])],
                         flow_prompt_speech_token=torch.randint(0, cfg.flow.vocab_size, (1, n_prompt)),
                         prompt_feat=torch.randn(1, 2 * n_prompt, 80), embedding=torch.randn(1, 192)).to("cuda")
    tokens = torch.randint(0, cfg.flow.vocab_size, (1, n_tokens), device="cuda")
    calls = plan(n_prompt, n_tokens, StreamParams())
    eager, fused = EagerFlow(flow, cfg), FusedFlow(flow, cfg)
    for _ in range(2):  # the second pass replays captured graphs
        for call in calls:
            ref = eager.chunk(None, inputs, tokens[:, :call.n_tokens], call)
            out = fused.chunk(None, inputs, tokens[:, :call.n_tokens], call)
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL
    assert fused.estimator.eager_calls == 0 and fused.estimator.replays > 0


# ------------------------------------------------------------------------------------ registration (CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fused_flow_is_offered_only_with_cuda_and_says_why(tiny_models):
    from cosyvoice_fast.engine.stages import build_stage_set
    from cosyvoice_fast.config.backends import BackendUnavailable
    from cosyvoice_fast.engine.stages import available_backends
    from cosyvoice_fast.config.backends import BackendConfig

    info = {(b.stage, b.name): b for b in available_backends("cpu")}
    assert not info[("flow", "fused")].available and "CUDA" in info[("flow", "fused")].reason
    with pytest.raises(BackendUnavailable, match="CUDA GPU"):
        build_stage_set(tiny_models, BackendConfig(flow="fused"))


@pytest.mark.parametrize("streaming", [True, False])
def test_estimator_flops_counts_every_frame_gemm(small, streaming):
    """The profile's FLOP count = the eager estimator's per-frame Linear/Conv1d work (from forward hooks) plus
    attention over the keys the chunk rule lets each query see."""
    from cosyvoice_fast.bench.estimator_profile import estimator_flops

    rows, frames = 2, 45
    total = []

    def hook(mod, inp, out):  # noqa: ANN001
        if isinstance(mod, torch.nn.Conv1d):
            total.append(2 * out.numel() * mod.in_channels * mod.kernel_size[0])
        elif out.dim() == 3:  # per-frame Linear (the time-embedding Linears act on (B, C) and are not counted)
            total.append(2 * out.numel() * mod.in_features)

    hooks = [m.register_forward_hook(hook) for m in small.modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))]
    try:
        with torch.no_grad():
            small(*estimator_inputs(small.cfg, rows, frames, torch.float32, "cpu"), streaming)
    finally:
        for h in hooks:
            h.remove()
    cfg = small.cfg
    chunk = cfg.static_chunk_size if streaming else frames
    keys = sum(min(frames, (i // chunk + 1) * chunk) for i in range(frames))
    n_attn = cfg.n_blocks * (2 + cfg.num_mid_blocks)
    attn = n_attn * 4 * rows * cfg.num_heads * cfg.attention_head_dim * keys
    assert estimator_flops(cfg, rows, frames, streaming) == sum(total) + attn
