"""The fused HiFT residual units (``kernels/hift_snake.py``) and the ``fused`` vocoder backend.

On CPU the Triton pass runs through the interpreter (``TRITON_INTERPRET=1``, set before Triton is imported).
The fused units change the order of two additions and the sine's implementation, so they are held to the eager
model's own accuracy: against a float64 evaluation of the same weights, the fused decode's error stays within
that of eager fp32 (plus float rounding), for whatever fixture is loaded.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.engine.stages import available_backends  # noqa: E402
from cosyvoice_fast.config.backends import BackendConfig  # noqa: E402
from cosyvoice_fast.vocoder.kernels.hift_snake import FusedSnakeResBlock, fuse_hift, snake_pass  # noqa: E402
from cosyvoice_fast.vocoder.model.hift import Snake, SnakeResBlock  # noqa: E402
from cosyvoice_fast.vocoder.model.source import F0Predictor  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("no_tf32")  # true fp32 references (fixture in conftest)


def snake_ref(z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    act = Snake(alpha.numel()).to(z.device)
    with torch.no_grad():
        act.alpha.copy_(alpha)
    return act(z)


@pytest.mark.parametrize("bias,residual,alpha,write_sum", [
    (False, False, True, False), (True, False, True, False), (True, True, True, True), (True, True, False, True)])
def test_snake_pass_matches_the_module_formula(bias, residual, alpha, write_sum):
    g = torch.Generator().manual_seed(0)
    b, c, t = 2, 5, 300  # t not a block multiple: the masked tail is exercised
    x = torch.randn(b, c, t, generator=g).to(DEV) * 3
    bs = torch.randn(c, generator=g).to(DEV) if bias else None
    res = torch.randn(b, c, t, generator=g).to(DEV) if residual else None
    al = torch.rand(c, generator=g).to(DEV) * 2 if alpha else None
    if al is not None:
        al[1] = 0.0  # a channel trained to zero frequency: the module's eps keeps it finite
    total, act = snake_pass(x, bias=bs, residual=res, alpha=al, write_sum=write_sum)
    z = x + (bs.view(1, -1, 1) if bias else 0)
    z = (res + z) if residual else z
    assert (total is not None) == write_sum and (act is not None) == alpha
    if write_sum:
        assert (total - z).abs().max().item() <= 1e-6
    if alpha:
        ref = snake_ref(z, al)
        assert torch.isfinite(act).all()
        assert (act - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


def test_snake_pass_keeps_a_time_major_layout_and_its_values():
    """Time-major (B, C, T) tensors (strides (T·C, 1, C), what cuDNN's NHWC convolutions read and write) go
    through the same pass without a copy to channel-major: same values, same layout out; a residual in the
    other layout is read correctly too."""
    from cosyvoice_fast.vocoder.model.hift import time_major

    g = torch.Generator().manual_seed(3)
    b, c, t = 2, 70, 90  # neither a tile multiple
    x = torch.randn(b, c, t, generator=g).to(DEV)
    res = torch.randn(b, c, t, generator=g).to(DEV)
    bias, alpha = torch.randn(c, generator=g).to(DEV), torch.rand(c, generator=g).to(DEV) + 0.1
    want = snake_pass(x, bias=bias, residual=res, alpha=alpha, write_sum=True)
    for residual in (time_major(res), res):
        got = snake_pass(time_major(x), bias=bias, residual=residual, alpha=alpha, write_sum=True)
        for g_, w in zip(got, want):
            assert g_.stride() == (t * c, 1, c)
            assert (g_ - w).abs().max().item() <= 1e-6


def test_triton_convs_need_the_time_major_stack(tiny_models):
    with pytest.raises(ValueError, match="triton_convs runs the conv stack time-major; pass time_major=True"):
        fuse_hift(tiny_models.hift.remove_weight_norm(), time_major=False, triton_convs=True)


def test_calls_of_more_rows_than_max_rows_keep_the_cudnn_convs(tiny_models, monkeypatch):
    """Above ``triton_max_rows`` (default 1) the Triton-conv model runs exactly the cuDNN-conv model's
    operations."""
    from cosyvoice_fast.vocoder.kernels import hift_conv

    with_triton = tiny_models.hift.remove_weight_norm().eval().to(DEV)
    without = tiny_models.hift.remove_weight_norm().eval().to(DEV)
    fuse_hift(with_triton, triton_convs=True)
    fuse_hift(without)
    g = torch.Generator().manual_seed(4)
    mel = (torch.randn(2, with_triton.cfg.in_channels, 6, generator=g) - 5).to(DEV)
    src = (torch.randn(2, 1, 6 * with_triton.samples_per_frame, generator=g) * 0.1).to(DEV)
    launches = []
    monkeypatch.setattr(hift_conv, "conv1d", lambda *a, **k: launches.append(1))
    assert hift_conv.TRITON_MAX_ROWS == 1
    assert hift_conv.use_triton(1) and not hift_conv.use_triton(2) and hift_conv.use_triton(2, max_rows=2)
    with torch.inference_mode():
        assert torch.equal(with_triton.decode(mel, src), without.decode(mel, src))
    assert launches == []


def test_snake_pass_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match=r"takes a \(B, C, T\) fp32 tensor, got \(3, 4\)"):
        snake_pass(torch.zeros(3, 4), alpha=torch.ones(4))
    with pytest.raises(ValueError, match="would compute nothing"):
        snake_pass(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"residual shape \(1, 2, 4\) differs"):
        snake_pass(torch.zeros(1, 2, 3), residual=torch.zeros(1, 2, 4), write_sum=True)


def test_fused_block_needs_folded_weights(tiny_models):
    blk = next(b for b in tiny_models.hift.resblocks if isinstance(b, SnakeResBlock))
    with pytest.raises(ValueError, match="fold the weight norm first"):
        FusedSnakeResBlock(blk)


@pytest.mark.parametrize("time_major,triton_convs", [(True, False), (False, False), (True, True)],
                         ids=["time_major", "channel_major", "triton_convs"])
def test_fused_hift_decode_is_as_close_to_float64_as_eager(tiny_models, time_major, triton_convs):
    """Whole filter pass (every resblock and source resblock fused) on the fixture's HiFT weights, its conv
    stack on time-major activations or not, or every Conv1d a Triton kernel (for the two rows here too)."""
    hift = tiny_models.hift
    plain = hift.remove_weight_norm().eval().to(DEV)
    fused = hift.remove_weight_norm().eval().to(DEV)
    n_blocks = len(fused.resblocks) + len(fused.source_resblocks)
    assert not fused.time_major
    assert fuse_hift(fused, time_major=time_major, triton_convs=triton_convs, triton_max_rows=2) == n_blocks
    assert fused.time_major == time_major and not plain.time_major
    unit_convs = sum(len(b.block.convs1) + len(b.block.convs2) for b in (*fused.resblocks, *fused.source_resblocks))
    with_4d = sum(hasattr(m, "weight4") for m in fused.modules())
    assert with_4d == (0 if not time_major else 2 + 2 * len(fused.ups) + unit_convs)
    # every Conv1d (not the transposed ones) packed for both precisions, the f0 predictor's for full fp32 only
    packed = sum(hasattr(m, "weight_kio") for m in fused.modules())
    packed_tf32 = sum(hasattr(m, "weight_kio_tf32") for m in fused.modules())
    assert packed == (2 + len(fused.ups) + unit_convs + F0Predictor.N_CONVS if triton_convs else 0)
    assert packed_tf32 == (2 + len(fused.ups) + unit_convs if triton_convs else 0)
    assert (fused.conv_override is not None) == triton_convs and plain.conv_override is None
    assert fuse_hift(fused, time_major=time_major) == 0  # already swapped: nothing left to fuse
    g = torch.Generator().manual_seed(1)
    frames = 8 if triton_convs and DEV == "cpu" else 24  # the interpreter runs the Triton convs' programs serially
    mel = (torch.randn(2, plain.cfg.in_channels, frames, generator=g) - 5).to(DEV)
    src = (torch.randn(2, 1, frames * plain.samples_per_frame, generator=g) * 0.1).to(DEV)
    with torch.inference_mode():
        eager = plain.decode(mel, src).double()
        out = fused.decode(mel, src).double()
        ref = copy.deepcopy(plain).double().decode(mel.double(), src.double())
    eager_err = (eager - ref).abs().max().item()
    fused_err = (out - ref).abs().max().item()
    assert out.shape == eager.shape
    assert fused_err <= 1.5 * eager_err + 1e-6, (fused_err, eager_err)


def test_fused_vocoder_is_listed_and_refused_without_cuda(tiny_models):
    assert BackendConfig(vocoder="fused").vocoder == "fused"
    info = {(b.stage, b.name): b for b in available_backends("cpu")}
    assert not info[("vocoder", "fused")].available and "CUDA" in info[("vocoder", "fused")].reason
    if not HAS_CUDA:
        from cosyvoice_fast.vocoder.fused import FusedVocoder

        with pytest.raises(BackendUnavailable, match="vocoder backend 'fused' needs a CUDA GPU"):
            FusedVocoder(tiny_models.hift)


@pytest.mark.gpu
@pytest.mark.parametrize("triton_convs", [False, True], ids=["cudnn_convs", "triton_convs"])
def test_gpu_fused_vocoder_is_as_close_to_float64_as_the_cudagraph_one(tiny_models, triton_convs):
    """The captured fused HiFT and the captured plain one (same chunks, same generators), one row and a batched
    graph of 4 rows, against a float64 evaluation on the same excitation: the fused error stays within the plain
    one's (a small random HiFT amplifies fp32 rounding through its log-magnitude, so the two differ by up to
    ~1e-4 on the fixture while both are that far from float64); and its residual units are the fused ones.
    With cuDNN's convolutions the excitation is the plain one's bit for bit; with the Triton convolutions f0 is
    summed in another order, so f0 agrees within float rounding and each output is held against float64 on
    its own excitation.  The Triton convolutions run the 4-row graph too (``triton_max_rows=4``)."""
    from cosyvoice_fast.vocoder.graph import CudaGraphVocoder
    from cosyvoice_fast.vocoder.fused import FusedVocoder

    hift = copy.deepcopy(tiny_models.hift).to("cuda")
    frames = 56
    plain = CudaGraphVocoder(hift, rows=(4,), lengths=(frames,), progress=False)
    fused = FusedVocoder(hift, rows=(4,), lengths=(frames,), progress=False, triton_convs=triton_convs,
                         triton_max_rows=4)
    assert all(isinstance(b, FusedSnakeResBlock) for b in fused.plain.resblocks)
    assert all(b.triton_convs == triton_convs for b in fused.plain.resblocks)
    ref64 = copy.deepcopy(plain.plain).double()
    g = torch.Generator().manual_seed(2)
    mels = (torch.randn(3, hift.cfg.in_channels, frames, generator=g) - 5).cuda()
    empty = torch.zeros(3, 1, 0, device="cuda")

    def gens() -> list[torch.Generator]:
        return [torch.Generator(device="cuda").manual_seed(10 + i) for i in range(3)]

    def errors(wav: torch.Tensor, src: torch.Tensor, mel: torch.Tensor) -> float:
        with torch.inference_mode():
            return (wav.double() - ref64.decode(mel.double(), src.double())).abs().max().item()

    w_plain, s_plain = plain.vocode(mels[:1], empty[:1], gens()[0])
    w_fused, s_fused = fused.vocode(mels[:1], empty[:1], gens()[0])
    if triton_convs:
        with torch.inference_mode():
            f0_ref, f0_got = plain._f0(mels), fused._f0(mels)
        assert (f0_got - f0_ref).abs().max().item() <= 1e-5 * max(1.0, f0_ref.abs().max().item())
    else:
        assert torch.equal(s_plain, s_fused)  # same excitation: the generators are used alike
    assert errors(w_fused, s_fused, mels[:1]) <= 1.5 * errors(w_plain, s_plain, mels[:1]) + 1e-6
    b_plain, bs_plain = plain.vocode_batch(mels, empty, gens())
    b_fused, bs_fused = fused.vocode_batch(mels, empty, gens())
    assert fused.batch_replays == 2 and fused.eager_batches == 0  # the lone chunk and the batch: 4-row graph
    assert errors(b_fused, bs_fused, mels) <= 1.5 * errors(b_plain, bs_plain, mels) + 1e-6


@pytest.mark.gpu
def test_gpu_triton_convs_in_tf32_are_as_close_to_fp32_as_cudnns(tiny_models):
    """As served (TF32 on): the Triton convolutions round their operands to TF32 as cuDNN does, so their
    waveform is no further from full fp32 than cuDNN's TF32 one (tensor cores alone would truncate, several
    times the error)."""
    from cosyvoice_fast.vocoder.fused import FusedVocoder

    hift = copy.deepcopy(tiny_models.hift).to("cuda")
    frames = 56
    torch.backends.cudnn.allow_tf32 = True  # the no_tf32 fixture restores it afterwards
    vocs = {t: FusedVocoder(hift, rows=(1,), lengths=(frames,), progress=False, triton_convs=t) for t in (0, 1)}
    ref = copy.deepcopy(vocs[0].plain)
    g = torch.Generator().manual_seed(6)
    mel = (torch.randn(1, hift.cfg.in_channels, frames, generator=g) - 5).cuda()
    errs = {}
    for t, voc in vocs.items():
        wav, src = voc.vocode(mel, torch.zeros(1, 1, 0, device="cuda"), torch.Generator(device="cuda").manual_seed(3))
        torch.backends.cudnn.allow_tf32 = False
        with torch.inference_mode():
            errs[t] = (wav - ref.decode(mel, src)).abs().max().item()
        torch.backends.cudnn.allow_tf32 = True
    assert errs[1] <= 1.5 * errs[0] + 1e-6, errs
