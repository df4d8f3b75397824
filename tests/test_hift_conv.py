"""HiFT's Triton convolutions (``kernels/hift_conv.py``): the kernel against ``torch.nn.functional.conv1d`` with
every epilogue, the tile choice, refusals, and the f0 predictor.

On CPU the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported),
whose ``tl.dot`` is a full-fp32 product, so the bounds below are float rounding of a reordered sum.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.vocoder.kernels import hift_conv  # noqa: E402
from cosyvoice_fast.vocoder.kernels.hift_conv import conv1d, conv_tiles, f0_fused, pack_weight, round_tf32  # noqa: E402
from cosyvoice_fast.vocoder.model.hift import Snake, time_major  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("no_tf32")  # true fp32 references (fixture in conftest)


def snake(z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    a = alpha.view(1, -1, 1)
    return z + (1.0 / (a + Snake.EPS)) * torch.sin(z * a).pow(2)


# (rows, C_in, C_out, T_in, kernel, stride, padding, dilation): a residual unit's dilated conv, the source
# downsampling's strided ones (HiFT's stride 3 / kernel 6 and stride 15 / kernel 30), conv_pre's 7 taps; channel
# counts that are not tile multiples, so the masked edges run
SHAPES = [(2, 20, 24, 37, 3, 1, 1, 1), (1, 18, 33, 91, 6, 3, 1, 1), (1, 18, 20, 60, 30, 15, 7, 1),
          (2, 40, 17, 50, 7, 1, 9, 3), (1, 64, 70, 130, 11, 1, 25, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["time_major", "channel_major"])
def test_conv_with_residual_and_snake_matches_torch(shape, layout):
    b, c_in, c_out, t, k, stride, pad, dil = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(b, c_in, t, generator=g).to(DEV)
    w = (torch.randn(c_out, c_in, k, generator=g) * 0.1).to(DEV)
    bias = torch.randn(c_out, generator=g).to(DEV)
    ref = F.conv1d(x, w, bias, stride=stride, padding=pad, dilation=dil)
    res = torch.randn(ref.shape, generator=g).to(DEV)
    alpha = (torch.rand(c_out, generator=g) + 0.1).to(DEV)
    alpha[0] = 0.0  # a channel trained to zero frequency: eps keeps 1 / alpha finite, as in the module
    tm = layout == "time_major"
    z, act = conv1d(time_major(x) if tm else x, pack_weight(w), bias, stride=stride, padding=pad, dilation=dil,
                    residual=res, alpha=alpha, time_major=tm)
    t_out = ref.shape[-1]
    assert z.shape == act.shape == ref.shape
    assert z.stride() == ((t_out * c_out, 1, c_out) if tm else (t_out * c_out, t_out, 1))
    scale = 1e-6 * max(1.0, ref.abs().max().item())
    assert (z - (ref + res)).abs().max().item() <= 4 * scale
    assert torch.isfinite(act).all()
    assert (act - snake(ref + res, alpha)).abs().max().item() <= 40 * scale


def test_conv_prologue_and_elu_match_torch():
    """``leaky_relu`` before the conv (HiFT's conv_post), ELU after it (the f0 predictor), one output only."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 24, 45, generator=g).to(DEV)
    w = (torch.randn(18, 24, 7, generator=g) * 0.2).to(DEV)
    bias = torch.randn(18, generator=g).to(DEV)
    z, act = conv1d(x, pack_weight(w), bias, padding=3, leaky_slope=0.01, elu=True, ieee=True, time_major=False)
    assert act is None
    ref = F.elu(F.conv1d(F.leaky_relu(x, 0.01), w, bias, padding=3))
    assert (z - ref).abs().max().item() <= 4e-6
    only_act = conv1d(x, pack_weight(w), bias, padding=3, write_sum=False, alpha=torch.ones(18, device=DEV))
    assert only_act[0] is None and only_act[1].shape == (2, 18, 45)


def test_tf32_rounding_is_to_nearest_with_ties_away():
    """TF32 keeps 10 mantissa bits: at 1.0 its step is 2**-10."""
    x = torch.tensor([1 + 2**-11, 1 + 2**-12, -(1 + 2**-11), 1 + 3 * 2**-11, 3.0, 0.0, float("inf")])
    want = torch.tensor([1 + 2**-10, 1.0, -(1 + 2**-10), 1 + 2 * 2**-10, 3.0, 0.0, float("inf")])
    assert torch.equal(round_tf32(x), want)
    w = torch.randn(6, 5, 3)
    assert torch.equal(pack_weight(w, tf32=True), round_tf32(pack_weight(w)))


@pytest.mark.skipif(DEV == "cuda", reason="the interpreter's dot is exact, so the rounding shows alone")
@pytest.mark.parametrize("input_rounded", [False, True])
def test_tf32_products_round_the_input_and_the_stored_snake(input_rounded):
    """TF32 products (``ieee=False``) read the input rounded to TF32 unless a producer already rounded it, and
    ``round_act`` stores the Snake output rounded; the sum output stays fp32.  The interpreter's ``tl.dot`` is
    exact, so against ``conv1d(round(x), round(w))`` only the summation order differs."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 24, 40, generator=g)
    w = torch.randn(20, 24, 5, generator=g) * 0.1
    bias, alpha = torch.randn(20, generator=g), torch.rand(20, generator=g) + 0.1
    x_in = round_tf32(x) if input_rounded else x
    z, act = conv1d(x_in, pack_weight(w, tf32=True), bias, padding=2, alpha=alpha, ieee=False,
                    input_rounded=input_rounded, round_act=True)
    ref = F.conv1d(round_tf32(x), round_tf32(w), bias, padding=2)
    assert (z - ref).abs().max().item() <= 4e-6
    assert (z - F.conv1d(x, w, bias, padding=2)).abs().max().item() > 1e-5  # the rounding is visible
    assert torch.equal(act, round_tf32(act))
    assert (act - snake(z, alpha)).abs().max().item() <= 2e-3 * snake(z, alpha).abs().max().item()
    full, full_act = conv1d(x, pack_weight(w), bias, padding=2, alpha=alpha, ieee=True, round_act=True)
    assert (full - F.conv1d(x, w, bias, padding=2)).abs().max().item() <= 4e-6
    assert not torch.equal(full_act, round_tf32(full_act))  # full fp32: nothing rounded


def test_tiles_keep_a_first_chunk_on_most_of_the_gpu():
    """A first chunk's shapes (one row) shrink the tiles until about MIN_PROGRAMS programs run, and time tiles of
    at most 32 steps take 128-channel input blocks; a 16-row batch keeps the largest tiles."""
    assert hift_conv.MIN_PROGRAMS == 132
    assert conv_tiles(1, 6001, 64, 64) == (32, 64, 64)  # last stage: 188 programs
    assert conv_tiles(16, 6001, 64, 64) == (128, 64, 64)
    assert conv_tiles(1, 400, 256, 256) == (16, 128, 32)  # first stage: 25 x 8 programs, 128 input channels
    assert conv_tiles(1, 50, 512, 512) == (16, 128, 16)  # the f0 predictor at 50 frames: 4 x 32 programs
    assert conv_tiles(1, 50, 80, 512) == (16, 128, 16)
    assert conv_tiles(1, 2000, 128, 128) == (32, 128, 32)  # second stage
    assert conv_tiles(2, 20, 18, 10) == (16, 32, 16)  # tiny: tl.dot's 16 x 16 minimum
    assert conv_tiles(1, 6001, 64, 64, min_programs=1) == (128, 64, 64)  # the interpreter's choice


def test_conv_refuses_what_it_cannot_compute():
    w = pack_weight(torch.zeros(4, 3, 5))
    with pytest.raises(ValueError, match=r"takes a \(B, C, T\) fp32 tensor, got \(3, 8\)"):
        conv1d(torch.zeros(3, 8), w, torch.zeros(4))
    with pytest.raises(ValueError, match=r"weight must be packed \(K, 2, C_out\) by pack_weight, got \(5, 3, 4\)"):
        conv1d(torch.zeros(1, 2, 8), w, torch.zeros(4))
    with pytest.raises(ValueError, match=r"bias must be \(4,\), got \(3,\)"):
        conv1d(torch.zeros(1, 3, 8), w, torch.zeros(3))
    with pytest.raises(ValueError, match="would store nothing"):
        conv1d(torch.zeros(1, 3, 8), w, torch.zeros(4), write_sum=False)
    with pytest.raises(ValueError, match="4 input steps give no output"):
        conv1d(torch.zeros(1, 3, 4), w, torch.zeros(4))
    with pytest.raises(ValueError, match=r"residual shape \(1, 4, 3\) differs from the output's \(1, 4, 4\)"):
        conv1d(torch.zeros(1, 3, 8), w, torch.zeros(4), residual=torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match=r"takes a Conv1d weight \(C_out, C_in, K\), got \(4, 3\)"):
        pack_weight(torch.zeros(4, 3))


def test_f0_predictor_in_fp32_kernels_matches_the_module(tiny_models):
    """The fixture's f0 predictor (weight norm folded): five conv + ELU launches in full fp32, the read-out in
    PyTorch, equal to the module within float rounding."""
    plain = tiny_models.hift.remove_weight_norm().eval().to(DEV)
    g = torch.Generator().manual_seed(7)
    mel = (torch.randn(2, plain.cfg.in_channels, 37, generator=g) - 5).to(DEV)
    with torch.inference_mode():
        ref = plain.f0(mel)
        got = f0_fused(plain.f0_predictor, mel)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    with pytest.raises(ValueError, match="needs the folded predictor"):
        f0_fused(tiny_models.hift.f0_predictor, mel.cpu())
