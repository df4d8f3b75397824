"""The one-shot estimator GEMM (``kernels/estimator_oneshot.py``) and ``linear``'s routing to it.

On CPU the kernel runs through Triton's interpreter (fp32, tiny sizes); the GPU tests compile it at the full
estimator's shapes.  Outputs are pre-filled with NaN, so a value the kernel forgets to write fails the test.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from cosyvoice_fast.flow.kernels import estimator_linear  # noqa: E402
from cosyvoice_fast.flow.kernels.tuning import GPU, default_tuning  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_linear import (
    ACT_GELU, ACT_NONE, ACT_SILU, PRO_LN, PRO_MISH, PRO_NONE, PRO_SINUS, linear,
)
from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_oneshot import oneshot_tiles as tiles_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("no_tf32")


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV)


def nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEV)


def reference(x, w, b, prologue, ln, act, residual):  # noqa: ANN001, ANN201
    a = {PRO_LN: lambda z: F.layer_norm(z, (x.shape[1],), *ln), PRO_MISH: F.mish}.get(prologue, lambda z: z)(x)
    y = {ACT_NONE: lambda z: z, ACT_GELU: F.gelu, ACT_SILU: F.silu}[act](F.linear(a, w, b))
    return y if residual is None else y + residual


@pytest.mark.parametrize("bk", [None, 16, 32])
@pytest.mark.parametrize("prologue,act,residual", [(PRO_NONE, ACT_NONE, True), (PRO_NONE, ACT_SILU, False),
                                                   (PRO_LN, ACT_GELU, True)])
def test_oneshot_matches_torch(prologue, act, residual, bk):
    """K of 72 in one step, or in ragged steps of 16 and 32 (5 and 3 steps; the LayerNorm prologue always takes
    the whole row in one step, whatever ``bk`` asks); M and N are no tile multiples."""
    m, k, n = 37, 72, 40
    x, w, b, g, beta = rnd(m, k), rnd(n, k) / 8, rnd(n), rnd(k), rnd(k)
    r = rnd(m, n) if residual else None
    tiles = {"bm": 16, "bn": 16, "warps": 4} if bk is None else {"bm": 16, "bn": 16, "warps": 4, "bk": bk, "stages": 2}
    out = linear_oneshot(x, w, b, prologue=prologue, ln=(g, beta, 1e-5), act=act, residual=r, out=nan(m, n),
                         tiles=tiles)
    assert (out - reference(x, w, b, prologue, (g, beta, 1e-5), act, r)).abs().max().item() <= TOL


def test_oneshot_row_mask_and_channel_first_store_without_bias():
    bsz, frames, k, n = 2, 13, 48, 20
    x, w = rnd(bsz * frames, k), rnd(n, k)
    mask = (torch.rand(bsz * frames, device=DEV) > 0.3).float()
    out = linear_oneshot(x, w, rowmask=mask, out=nan(bsz, n, frames), out_btc=(bsz, frames))
    ref = (F.linear(x, w) * mask[:, None]).view(bsz, frames, n).transpose(1, 2)
    assert (out - ref).abs().max().item() <= TOL


def test_oneshot_refuses_what_it_cannot_compute():
    x, w = rnd(4, 16), rnd(8, 16)
    for prologue in (PRO_MISH, PRO_SINUS):
        with pytest.raises(ValueError, match=f"prologue {prologue} is not PRO_NONE or PRO_LN; use linear"):
            linear_oneshot(x, w, prologue=prologue)
    with pytest.raises(ValueError, match=r"LayerNorm prologue needs ln=\(gamma, beta, eps\)"):
        linear_oneshot(x, w, prologue=PRO_LN)
    with pytest.raises(ValueError, match=r"x must be \(M, 16\)"):
        linear_oneshot(rnd(4, 12), w)
    with pytest.raises(ValueError, match=r"residual must be \(4, 8\)"):
        linear_oneshot(x, w, residual=rnd(4, 9))


def test_linear_routes_few_rows_to_the_oneshot_gemm(monkeypatch):
    """Up to ``FlowTuning.oneshot_max_rows`` rows ``linear`` hands plain and LayerNorm-prologue calls to the
    one-shot GEMM; the Mish and sinusoidal prologues and a ``norm_out`` request stay on the row-tiled kernel,
    and nothing goes with the switch off."""
    calls = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(kwargs.get("prologue"))
        return linear_oneshot(*args, **kwargs)

    monkeypatch.setattr(estimator_linear, "linear_oneshot", spy)
    x, w, b, g, beta = rnd(9, 32), rnd(24, 32), rnd(24), rnd(32), rnd(32)
    out = linear(x, w, b, prologue=PRO_LN, ln=(g, beta, 1e-5), act=ACT_GELU)
    assert calls == [PRO_LN]
    assert (out - reference(x, w, b, PRO_LN, (g, beta, 1e-5), ACT_GELU, None)).abs().max().item() <= TOL
    linear(x, w, b)
    assert calls == [PRO_LN, PRO_NONE]
    out = linear(x, w, b, prologue=PRO_MISH)
    assert (out - reference(x, w, b, PRO_MISH, None, ACT_NONE, None)).abs().max().item() <= TOL
    import math

    freqs = torch.exp(torch.arange(16, device=DEV, dtype=torch.float32) * -(math.log(10000) / 15))
    linear(torch.rand(3, device=DEV), w, b, prologue=PRO_SINUS, freqs=freqs)
    linear(x, rnd(32, 32), residual=x, norm_out=(nan(9, 32), (g, beta, 1e-5)))
    linear(x, w, b, tuning=replace(default_tuning(), oneshot_max_rows=8))  # 9 rows: above the limit
    linear(x, w, b, tuning=replace(default_tuning(), oneshot_max_rows=9, oneshot=False))
    assert calls == [PRO_LN, PRO_NONE]


def test_oneshot_tiles_follow_the_measured_table():
    """16-bit GPU tiles by shape and rows as measured on an H100; fp32 takes small tiles and K steps."""
    bf16 = torch.bfloat16

    def oneshot_tiles(*args):  # noqa: ANN002, ANN202 - the GPU table whatever runs the test
        return tiles_for(*args, tuning=GPU)

    # one CFG pair of 100-250 frames (129-512 rows): the tiles chosen over the whole forward
    assert oneshot_tiles(400, 1536, 256, bf16) == {"bm": 32, "bn": 256, "warps": 8}  # q/k/v
    assert oneshot_tiles(200, 1536, 256, bf16) == {"bm": 32, "bn": 256, "warps": 8}
    assert oneshot_tiles(500, 1024, 256, bf16) == {"bm": 32, "bn": 128, "warps": 8}  # FF1
    assert oneshot_tiles(300, 256, 512, bf16) == {"bm": 32, "bn": 32, "warps": 4}  # out-projection
    assert oneshot_tiles(512, 256, 1024, bf16) == {"bm": 64, "bn": 16, "warps": 4, "bk": 256, "stages": 2}  # FF2
    assert oneshot_tiles(400, 80, 256, bf16) == {"bm": 32, "bn": 64, "warps": 4}  # the final projection
    # above the pair (only when a caller raises oneshot_max_rows): the tiles measured best at 412 rows
    assert oneshot_tiles(513, 1536, 256, bf16) == {"bm": 64, "bn": 128, "warps": 8}
    assert oneshot_tiles(513, 256, 512, bf16) == {"bm": 64, "bn": 64, "warps": 4}
    assert oneshot_tiles(513, 256, 1024, bf16)["bk"] == 256  # FF2: pipelined K steps
    # few rows: at most 2 x 64 frames
    assert oneshot_tiles(128, 1536, 256, bf16) == {"bm": 32, "bn": 64, "warps": 4}
    assert oneshot_tiles(112, 1024, 256, bf16) == {"bm": 32, "bn": 64, "warps": 4}
    assert oneshot_tiles(112, 256, 512, bf16) == {"bm": 16, "bn": 16, "warps": 4}
    assert oneshot_tiles(112, 256, 1024, bf16)["bk"] == 1024  # one step
    assert oneshot_tiles(412, 256, 1024, torch.float32) == GPU.oneshot_tiles["fp32"]


def test_pair_rows_pick_the_pair_attention_and_conv_tiles():
    """Over the pair rows (one request's CFG pair of 100-250 frames) attention and the convolutions take the tiles
    chosen with the pair GEMMs; more rows (a batched solve) and fewer keep the shared ones; fp32 and the
    interpreter keep theirs."""
    from cosyvoice_fast.flow.kernels.estimator_attention import attention_tiles
    from cosyvoice_fast.flow.kernels.estimator_conv import conv_tiles
    from cosyvoice_fast.flow.kernels.tuning import INTERPRETER

    assert GPU.oneshot_max_rows == GPU.pair_rows[1] == 512 and GPU.pair_rows[0] == 129

    def tiles(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        return attention_tiles(*args, tuning=GPU, **kw)

    assert tiles(200, 400) == GPU.attn_pair == {"bm": 32, "bn": 128, "warps": 4, "stages": 3}
    assert tiles(250, 512) == GPU.attn_pair
    assert tiles(200, 800) == tiles(200) == tiles(56, 112) == GPU.attn == {"bm": 64, "bn": 64, "warps": 4, "stages": 3}
    assert tiles(200, 400, fp32=True) == GPU.attn
    assert tiles(30, 60)["bm"] == 16  # short rows: the small tiles
    assert attention_tiles(200, 400, tuning=INTERPRETER) == GPU.attn
    assert conv_tiles(400, False, GPU)["bm"] == 16 and conv_tiles(400, False, GPU) == GPU.conv_pair
    assert conv_tiles(513, False, GPU) == conv_tiles(128, False, GPU) == GPU.conv
    assert conv_tiles(4096, False, GPU) == GPU.conv_large
    assert conv_tiles(400, True, GPU) == GPU.conv_fp32
    assert conv_tiles(400, False, INTERPRETER) == conv_tiles(4096, True, INTERPRETER) == INTERPRETER.conv


# ------------------------------------------------------------------------------------------ GPU, full size

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [112, 412])
@pytest.mark.parametrize("n,k,prologue,act,residual", [(1536, 256, PRO_LN, ACT_NONE, False),
                                                       (256, 512, PRO_NONE, ACT_NONE, True),
                                                       (1024, 256, PRO_LN, ACT_GELU, False),
                                                       (256, 1024, PRO_NONE, ACT_NONE, True)])
def test_gpu_full_size_shapes_fp32_and_bf16(rows, n, k, prologue, act, residual):
    """The estimator's GEMM shapes with the compiled tiles: fp32 (IEEE dots) within 1e-4 of torch; bf16 within
    the row-tiled kernel's own error against the fp32 reference (both accumulate in fp32 and round once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(rows + n + k)
    x, w, b = rnd(rows, k), rnd(n, k) / k ** 0.5, rnd(n) / 10
    ln = (1 + rnd(k) / 10, rnd(k) / 10, 1e-5)
    r = rnd(rows, n) if residual else None
    ref = reference(x, w, b, prologue, ln, act, r)
    out = linear_oneshot(x, w, b, prologue=prologue, ln=ln, act=act, residual=r, out=nan(rows, n))
    assert (out - ref).abs().max().item() <= TOL
    x16, w16, b16 = (z.to(torch.bfloat16) for z in (x, w, b))
    ln16 = (ln[0].to(torch.bfloat16), ln[1].to(torch.bfloat16), 1e-5)
    r16 = None if r is None else r.to(torch.bfloat16)
    one = linear_oneshot(x16, w16, b16, prologue=prologue, ln=ln16, act=act, residual=r16)
    tiled = linear(x16, w16, b16, prologue=prologue, ln=ln16, act=act, residual=r16,
                   tuning=replace(GPU, oneshot=False))
    e_one = (one.float() - ref).abs().max().item()
    e_tiled = (tiled.float() - ref).abs().max().item()
    assert torch.isfinite(one).all() and e_one <= 1.25 * e_tiled + 1e-3
