"""Each fused estimator kernel against eager PyTorch, at tiny sizes.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is
imported); on a GPU they are compiled.  Inputs are fresh random draws; outputs are pre-filled with NaN where the
wrapper accepts an output buffer, so a value the kernel forgets to write fails the test.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from cosyvoice_fast.flow.kernels.estimator_attention import attention  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_conv import causal_conv, pack_conv_weight  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import pack_inputs  # noqa: E402
from cosyvoice_fast.flow.kernels.tuning import Tiles, default_tuning  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_linear import (
    ACT_GELU, ACT_MISH, ACT_NONE, ACT_SILU, PRO_LN, PRO_MISH, PRO_SINUS, linear, spread_tiles,
)
from cosyvoice_fast.kernels.pdl import pdl_options  # noqa: E402
from cosyvoice_fast.flow.model.decoder import attention_allowed, sinusoidal_embedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
ACTS = {ACT_NONE: lambda z: z, ACT_GELU: F.gelu, ACT_SILU: F.silu, ACT_MISH: F.mish}


pytestmark = pytest.mark.usefixtures("no_tf32")  # true fp32 references (fixture in conftest)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEV)


def nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEV)


@pytest.mark.parametrize("oneshot", [True, False])
@pytest.mark.parametrize("prologue,act,residual", [(PRO_LN, ACT_GELU, False), (0, ACT_NONE, True),
                                                   (PRO_MISH, ACT_SILU, False), (0, ACT_MISH, True)])
def test_linear_matches_torch(prologue, act, residual, oneshot):
    """Both kernels behind ``linear`` below the many-rows path: the one-shot GEMM and the row-tiled one."""
    tuning = replace(default_tuning(), oneshot=oneshot)
    m, k, n = 21, 72, 40  # none a tile multiple: every mask edge is exercised
    x, w, b = rnd(m, k), rnd(n, k) / 8, rnd(n)
    g, beta = rnd(k), rnd(k)
    r = rnd(m, n) if residual else None
    out = linear(x, w, b, prologue=prologue, ln=(g, beta, 1e-5), act=act, residual=r, out=nan(m, n), tuning=tuning)
    a = {PRO_LN: lambda z: F.layer_norm(z, (k,), g, beta, 1e-5), PRO_MISH: F.mish}.get(prologue, lambda z: z)(x)
    ref = ACTS[act](F.linear(a, w, b)) + (r if residual else 0)
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("prologue", [PRO_LN, PRO_MISH, 0])
def test_linear_early_weight_tile_gives_the_same_bits(prologue):
    """``FlowTuning.early_weights`` loads the first weight tile before the PDL wait (the K loop's first step is
    peeled off); K spans three tiles with a ragged tail, and both orders must give the same bits."""
    m, k, n = 19, 150, 40
    x, w, b = rnd(m, k), rnd(n, k) / 8, rnd(n)
    g, beta = rnd(k), rnd(k)
    outs = []
    for early in (False, True):  # the row-tiled kernel's K loop (no one-shot GEMM)
        tuning = replace(default_tuning(), oneshot=False, early_weights=early)
        outs.append(linear(x, w, b, prologue=prologue, ln=(g, beta, 1e-5), act=ACT_GELU, out=nan(m, n),
                           tuning=tuning))
    assert torch.equal(outs[0], outs[1])
    a = {PRO_LN: lambda z: F.layer_norm(z, (k,), g, beta, 1e-5), PRO_MISH: F.mish}.get(prologue, lambda z: z)(x)
    assert (outs[1] - F.gelu(F.linear(a, w, b))).abs().max().item() <= TOL


def test_spread_tiles_narrows_columns_then_rows_until_the_launch_fills():
    # one CFG pair of 206 frames, N = 256: 13 x 4 = 52 programs -> 13 x 8 = 104 -> 26 x 8 = 208
    assert spread_tiles(412, 256, 32, 64, 132) == (16, 32)
    assert spread_tiles(412, 256, 32, 64, 100) == (32, 32)
    assert spread_tiles(412, 256, 32, 64, 0) == (32, 64)
    assert spread_tiles(412, 1024, 32, 64, 132) == (32, 64)  # 208 programs already
    assert spread_tiles(16, 32, 16, 32, 10**6) == (16, 32)  # never below 16 x 32


def test_narrowed_tiles_compute_the_same_gemm_and_conv():
    """With ``min_programs`` the GEMM and the plain causal conv run on 16 x 32 tiles: same results."""
    base = default_tuning()
    # the row-tiled GEMM is the one that narrows its tiles (no one-shot GEMM)
    tuning = replace(base, oneshot=False, **{kind: Tiles(**{**getattr(base, kind), "min_programs": 10**6})
                                            for kind in ("linear", "linear_fp32", "conv", "conv_fp32")})
    m, k, n = 40, 48, 72
    x, w, b, r = rnd(m, k), rnd(n, k) / 8, rnd(n), rnd(m, n)
    out = linear(x, w, b, act=ACT_GELU, residual=r, out=nan(m, n), tuning=tuning)
    assert (out - (F.gelu(F.linear(x, w, b)) + r)).abs().max().item() <= TOL
    frames, c = 20, 24
    xc, wc, bc = rnd(2 * frames, c), rnd(n, c, 3) / 8, rnd(n)
    mask = torch.ones(2 * frames, device=DEV)
    y = causal_conv(xc, mask, pack_conv_weight(wc), bc, frames, tuning=tuning)
    ref = F.conv1d(F.pad(xc.view(2, frames, c).transpose(1, 2), (2, 0)), wc, bc).transpose(1, 2).reshape(2 * frames, n)
    assert (y - ref).abs().max().item() <= TOL


def test_pdl_is_asked_for_only_on_cuda_tensors():
    cpu = torch.zeros(1)
    assert pdl_options(True, cpu) == {"PDL": False}
    assert pdl_options(False, cpu) == {"PDL": False}
    if torch.cuda.is_available():
        assert pdl_options(True, cpu.cuda()) == {"PDL": True, "launch_pdl": True}
        assert pdl_options(False, cpu.cuda()) == {"PDL": False}


def test_linear_sinusoidal_prologue_is_the_time_embedding():
    dim, n = 32, 24
    t = torch.rand(3, device=DEV)
    w, b = rnd(n, dim) / 4, rnd(n)
    half = dim // 2
    import math

    freqs = torch.exp(torch.arange(half, device=DEV, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    out = linear(t, w, b, prologue=PRO_SINUS, act=ACT_SILU, freqs=freqs, out=nan(3, n))
    ref = F.silu(F.linear(sinusoidal_embedding(t, dim), w, b))
    assert (out - ref).abs().max().item() <= TOL
    # the CFM passes one time for both CFG rows as an expanded (stride-0) view
    shared = t[:1].expand(4)
    out = linear(shared, w, b, prologue=PRO_SINUS, act=ACT_SILU, freqs=freqs, out=nan(4, n))
    assert (out - F.silu(F.linear(sinusoidal_embedding(shared, dim), w, b))).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="freqs"):
        linear(t, w, b, prologue=PRO_SINUS)


@pytest.mark.parametrize("oneshot", [True, False])
def test_linear_row_mask_and_channel_first_store(oneshot):
    bsz, frames, k, n = 2, 13, 32, 20
    x, w, b = rnd(bsz * frames, k), rnd(n, k), rnd(n)
    mask = (torch.rand(bsz * frames, device=DEV) > 0.3).float()
    out = linear(x, w, b, rowmask=mask, out=nan(bsz, n, frames), out_btc=(bsz, frames),
                 tuning=replace(default_tuning(), oneshot=oneshot))
    ref = (F.linear(x, w, b) * mask[:, None]).view(bsz, frames, n).transpose(1, 2)
    assert (out - ref).abs().max().item() <= TOL


_TILE_VARIANTS = {  # tiles that split a 70-frame row into several query and key blocks, and a 20-frame chunk
    "16x16": {"bm": 16, "bn": 16, "warps": 4, "stages": 3},
    "32x16": {"bm": 32, "bn": 16, "warps": 4, "stages": 2},
    "16x32": {"bm": 16, "bn": 32, "warps": 4, "stages": 3},
}


@pytest.mark.parametrize("chunk,frames,tiles,d", [(0, 37, None, 16), (10, 37, None, 16), (0, 37, None, 24),
                                                  (10, 37, None, 40)]
                         + [(c, 70, v, 16) for c in (0, 20) for v in _TILE_VARIANTS] + [(20, 70, "16x32", 24)])
def test_attention_with_the_chunk_rule_as_an_index(chunk, frames, tiles, d):
    """Head sizes 24 and 40 (not powers of two) run on lanes padded to 32 and 64, masked past the head."""
    bsz, heads = 3, 2
    qkv = rnd(bsz * frames, 3 * heads * d)
    mask = torch.ones(bsz, 1, frames, device=DEV)
    mask[1, :, 25:] = 0  # right padding
    mask[2] = 0  # an all-padding row
    out = attention(qkv, mask.reshape(-1), bsz, heads, d, chunk, out=nan(bsz * frames, heads * d),
                    tiles=None if tiles is None else _TILE_VARIANTS[tiles])
    q, k, v = qkv.view(bsz, frames, 3, heads, d).permute(2, 0, 3, 1, 4)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_allowed(mask, chunk).unsqueeze(1))
    ref = ref.transpose(1, 2).reshape(bsz * frames, heads * d)
    pos = torch.arange(frames, device=DEV)
    limit = (pos // chunk + 1) * chunk if chunk else torch.full_like(pos, frames)
    sees = (mask.bool() & (pos[None, None, :] < limit[None, :, None])).any(-1).reshape(-1)  # (B*T,) any key
    assert sees[:25].all() and not sees[2 * frames:].any()
    assert (out[sees] - ref[sees]).abs().max().item() <= TOL  # every frame with a visible key equals eager
    assert torch.isfinite(out).all() and not out[~sees].any()  # frames that see no key are 0, not NaN


@pytest.mark.parametrize("two_sources", [False, True])
def test_causal_conv_resnet_half(two_sources):
    """conv(x·m) -> LayerNorm -> Mish -> ·m -> + vec[b], plus the 1x1 residual projection of x·m."""
    bsz, frames, c1, c2, n = 2, 11, 24, 16 if two_sources else 0, 32
    x1, x2 = rnd(bsz * frames, c1), rnd(bsz * frames, c2) if two_sources else None
    mask = torch.ones(bsz, frames, device=DEV)
    mask[1, 7:] = 0
    m = mask.reshape(-1)
    w, b, g, beta = rnd(n, c1 + c2, 3) / 6, rnd(n), rnd(n), rnd(n)
    wr, br, vec = rnd(n, c1 + c2) / 6, rnd(n), rnd(bsz, 3 * n)
    res = nan(bsz * frames, n)
    out = causal_conv(x1, m, pack_conv_weight(w), b, frames, x2=x2, ln=(g, beta, 1e-5), act=ACT_MISH,
                      out_mask=True, vec=vec[:, n:2 * n], res_weight=wr, res_bias=br, res_out=res)
    xin = x1 if x2 is None else torch.cat([x1, x2], 1)
    xcf = xin.view(bsz, frames, -1).transpose(1, 2) * mask[:, None]  # (B, C, T), masked
    conv = F.conv1d(F.pad(xcf, (2, 0)), w, b)
    h = F.mish(F.layer_norm(conv.transpose(1, 2), (n,), g, beta, 1e-5)) * mask[:, :, None]
    ref = (h + vec[:, None, n:2 * n]).reshape(bsz * frames, n)
    ref_res = F.conv1d(xcf, wr[:, :, None], br).transpose(1, 2).reshape(bsz * frames, n)
    assert (out - ref).abs().max().item() <= TOL
    assert (res - ref_res).abs().max().item() <= TOL


def test_causal_conv_plain_with_residual_add():
    bsz, frames, c, n = 2, 9, 20, 24
    x, r = rnd(bsz * frames, c), rnd(bsz * frames, n)
    m = torch.ones(bsz * frames, device=DEV)
    w, b = rnd(n, c, 3), rnd(n)
    out = causal_conv(x, m, pack_conv_weight(w), b, frames, residual=r)
    xcf = x.view(bsz, frames, c).transpose(1, 2)
    ref = F.conv1d(F.pad(xcf, (2, 0)), w, b).transpose(1, 2).reshape(bsz * frames, n) + r
    assert (out - ref).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="packed"):
        causal_conv(x, m, w.reshape(n, -1)[:, :-1].contiguous(), b, frames)


def test_pack_inputs_is_the_channel_concatenation():
    bsz, c, frames = 2, 20, 13
    x, mu, cond, spks = rnd(bsz, c, frames), rnd(bsz, c, frames), rnd(bsz, c, frames), rnd(bsz, c)
    out = pack_inputs(x, mu, spks, cond)
    ref = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, frames), cond], 1).transpose(1, 2).reshape(bsz * frames, -1)
    assert torch.equal(out, ref)


def test_row_epilogue_is_the_conv_epilogue():
    """GEMM-only conv + row pass = the conv with its LayerNorm epilogue fused."""
    from cosyvoice_fast.flow.kernels.estimator_conv import row_epilogue

    bsz, frames, c, n = 2, 11, 24, 40
    x, r, vec = rnd(bsz * frames, c), rnd(bsz * frames, n), rnd(bsz, n)
    m = torch.ones(bsz, frames, device=DEV)
    m[0, 6:] = 0
    m = m.reshape(-1)
    w, b, g, beta = pack_conv_weight(rnd(n, c, 3) / 5), rnd(n), rnd(n), rnd(n)
    fused = causal_conv(x, m, w, b, frames, ln=(g, beta, 1e-5), act=ACT_MISH, out_mask=True, vec=vec, residual=r)
    split = row_epilogue(causal_conv(x, m, w, b, frames), m, (g, beta, 1e-5), frames, act=ACT_MISH, vec=vec,
                         residual=r)
    assert (split - fused).abs().max().item() <= TOL


@pytest.mark.parametrize("prologue,act,residual,rowmask,btc", [(PRO_LN, 0, False, False, False),
                                                               (PRO_LN, ACT_GELU, False, False, False),
                                                               (0, ACT_NONE, True, False, False),
                                                               (0, ACT_NONE, False, True, True)])
def test_linear_many_rows_path_matches_torch_in_bf16(prologue, act, residual, rowmask, btc):
    """From ``many_rows_m`` rows on, 16-bit GEMMs take the many-rows path (here forced at 42 rows): cuBLAS with a Triton
    epilogue (a plain product, the first and last cases), or the tall Triton kernel with the epilogue fused in.
    The same function as the fused kernel, within one bf16 rounding of the product (bf16 inputs, fp32
    reference)."""
    from cosyvoice_fast.flow.kernels import estimator_cublas

    tuning = replace(default_tuning(), many_rows_m=8)
    b, t, k, n = 2, 21, 64, 40
    m = b * t
    bf = torch.bfloat16
    x, w, bias = rnd(m, k).to(bf), (rnd(n, k) / 8).to(bf), rnd(n).to(bf)
    g, beta = rnd(k).to(bf), rnd(k).to(bf)
    r = rnd(m, n).to(bf) if residual else None
    mask = (torch.arange(m, device=DEV) % t < 15).to(bf) if rowmask else None
    out = linear(x, w, None if prologue == PRO_LN and act == 0 else bias, prologue=prologue, ln=(g, beta, 1e-5),
                 act=act, residual=r, rowmask=mask, out_btc=(b, t) if btc else None, tuning=tuning)
    a = F.layer_norm(x.float(), (k,), g.float(), beta.float(), 1e-5) if prologue == PRO_LN else x.float()
    ref = F.linear(a, w.float(), None if prologue == PRO_LN and act == 0 else bias.float())
    ref = ACTS[act](ref) + (r.float() if residual else 0)
    if rowmask:
        ref = ref * mask.float()[:, None]
    if btc:
        ref = ref.view(b, t, n).transpose(1, 2)
    assert out.shape == ref.shape and out.dtype == bf
    assert (out.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    assert estimator_cublas.use_many_rows(m, w, prologue, tuning)
    assert not estimator_cublas.use_many_rows(m, w.float(), prologue, tuning)


@pytest.mark.parametrize("n,dtype,bias,rowmask", [(32, torch.bfloat16, True, False), (48, torch.bfloat16, False, False),
                                                  (48, torch.bfloat16, True, True), (48, torch.float16, True, True)])
def test_many_rows_epilogue_writes_the_layer_norm_of_its_stored_rows(n, dtype, bias, rowmask):
    """``norm_out`` on the many-rows path (forced at 42 rows): the epilogue's second output is ``F.layer_norm``
    of the rows it returns, within one ulp of the 16-bit type (relative ``finfo.eps``, plus 1e-5 absolute): both
    round nearly the same fp32 value (and the interpreter truncates to bf16 where ``F.layer_norm`` rounds).
    The returned rows are the product within one 16-bit rounding (this case runs cuBLAS and the epilogue pass;
    without ``norm_out`` the tall kernel would take it); N = 48 is not a power of two, so the
    whole-row tile's masked columns are exercised."""
    from cosyvoice_fast.flow.kernels import estimator_cublas

    tuning = replace(default_tuning(), many_rows_m=8)
    m, k = 42, 64
    x, w, b = rnd(m, k).to(dtype), (rnd(n, k) / 8).to(dtype), rnd(n).to(dtype) if bias else None
    r = rnd(m, n).to(dtype)
    mask = (torch.arange(m, device=DEV) % 21 < 15).to(dtype) if rowmask else None
    g, beta = rnd(n).to(dtype), rnd(n).to(dtype)
    assert estimator_cublas.use_many_rows(m, w, 0, tuning)
    normed = nan(m, n).to(dtype)
    out = linear(x, w, b, residual=r, rowmask=mask, norm_out=(normed, (g, beta, 1e-5)), tuning=tuning)
    ref_rows = (F.linear(x.float(), w.float(), None if b is None else b.float()) + r.float())
    ref_rows = ref_rows * (mask.float()[:, None] if rowmask else 1)
    assert (out.float() - ref_rows).abs().max().item() <= 0.02 * ref_rows.abs().max().item()
    ref = F.layer_norm(out, (n,), g, beta, 1e-5).float()
    ulp = torch.finfo(dtype).eps * torch.maximum(ref.abs(), normed.float().abs())
    assert ((normed.float() - ref).abs() <= ulp + 1e-5).all()


@pytest.mark.parametrize("m,k,n,tiles", [(70, 72, 40, None), (70, 64, 48, {"bm": 32, "bn": 16, "bk": 16,
                                                                           "warps": 4, "stages": 1})])
def test_tall_gemm_matches_torch_in_fp32(m, k, n, tiles):
    """The tall Triton GEMM on its own in fp32 (IEEE dots): bias, GELU, residual, row mask and the (B, N, T)
    store, with M, K and N off the tile sizes (a K loop with a masked last step, masked rows and columns), and
    with several column tiles per row; the next LayerNorm of its rows when asked (a whole-row tile)."""
    from cosyvoice_fast.flow.kernels.estimator_tall import linear_tall

    b, t = 2, m // 2
    x, w, bias, r = rnd(m, k), rnd(n, k) / 8, rnd(n), rnd(m, n)
    mask = (torch.arange(m, device=DEV) % t < t - 4).float()
    ref = (F.gelu(F.linear(x, w, bias)) + r) * mask[:, None]
    out = nan(b, n, t)
    linear_tall(x, w, bias, act=ACT_GELU, residual=r, rowmask=mask, out=out, rows_per_b=t,
                out_strides=(out.stride(0), out.stride(2), out.stride(1)), tiles=tiles)
    assert (out - ref.view(b, t, n).transpose(1, 2)).abs().max().item() <= TOL
    g, beta, normed, rows = rnd(n), rnd(n), nan(m, n), nan(m, n)
    linear_tall(x, w, bias, act=ACT_NONE, residual=r, rowmask=None, out=rows, rows_per_b=m,
                out_strides=(0, n, 1), norm_out=(normed, (g, beta, 1e-5)), tiles=tiles)
    assert (rows - (F.linear(x, w, bias) + r)).abs().max().item() <= TOL
    assert (normed - F.layer_norm(rows, (n,), g, beta, 1e-5)).abs().max().item() <= TOL


def test_norm_out_is_filled_on_the_fused_path_and_checked():
    """Below ``many_rows_m`` (the fused Triton kernel) ``norm_out`` is still filled, by a separate LayerNorm pass, so
    a caller that passes it where cuBLAS does not apply gets the right rows; it is refused for the (B, N, T)
    layout and for a wrong shape."""
    m, k, n = 21, 32, 48
    x, w, r = rnd(m, k), rnd(n, k) / 8, rnd(m, n)
    g, beta = rnd(n), rnd(n)
    normed = nan(m, n)
    out = linear(x, w, residual=r, norm_out=(normed, (g, beta, 1e-5)))
    assert (normed - F.layer_norm(out, (n,), g, beta, 1e-5)).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="out_btc"):
        linear(x, w, out_btc=(3, 7), norm_out=(nan(m, n), (g, beta, 1e-5)))
    with pytest.raises(ValueError, match="norm_out must be"):
        linear(x, w, norm_out=(nan(m, n + 1), (g, beta, 1e-5)))
