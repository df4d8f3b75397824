"""Triton causal grouped Conv1d + Mish of CosyVoice3's DiT position embedding, on channels-last rows.

The DiT's input embedding adds ``Mish(conv2(pad(Mish(conv1(pad(h))))))`` to ``h`` (two grouped convs, left
padded by ``kernel - 1`` zeros, so a frame sees only frames to its left).  Through cuDNN the two convs cost
about 1 ms a forward on an H100 at any batch (a slow grouped-conv kernel plus NCHW <-> NHWC transposes of the
channels-last rows); the work is 2 x 0.9 GFLOP at one request's 2 x 112 frames, microseconds of tensor-core time.

Here a program owns ``BT`` frames of one batch row and one group: for each of the ``kernel`` taps it loads the
(BT, Cg) input rows shifted by the tap (zeros before frame 0: the causal padding) and multiplies them by that
tap's (Cg, Cg) weight block with a tensor-core dot, accumulating in fp32; bias, Mish (and for the second conv
the residual ``h``) are the epilogue.  Rows are the DiT's (B·T, C) residual layout, so no transpose is made.
Narrow groups (the tiny fixture's 4 channels) are packed several to a program as one block-diagonal weight
(:func:`groups_per_program`), so a program's dot is at least 64 lanes (or all channels) wide.  fp32 operands use
IEEE fp32 dots (not TF32): the parity tests compare with eager fp32 at 1e-5.

Weights are packed once by :func:`pack_conv_weight` to (programs' groups, kernel, lanes_in, lanes_out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import _act, interpreting


@triton.jit
def _causal_conv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, T, C, CG, KS,
                        HAS_RES: tl.constexpr, IEEE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2)
    rt = pid_t * BT + tl.arange(0, BT)
    rc = tl.arange(0, BC)
    t_ok = rt < T
    c_ok = rc < CG
    w_ok = c_ok[:, None] & c_ok[None, :]
    col = g * CG + rc
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in range(0, KS):
        src = rt - (KS - 1) + k
        s_ok = (src >= 0) & t_ok
        a = tl.load(x_ptr + (b * T + src)[:, None] * C + col[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_ptr + ((g * KS + k) * CG + rc[:, None]) * CG + rc[None, :], mask=w_ok, other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    acc += tl.load(b_ptr + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    out = _act(acc, 3)
    offs = (b * T + rt)[:, None] * C + col[None, :]
    ok = t_ok[:, None] & c_ok[None, :]
    if HAS_RES:
        out += tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=ok)


def groups_per_program(channels: int, groups: int) -> int:
    """How many conv groups one program computes: the most that divide ``groups`` within 64 lanes (1 for the
    real model's 64-channel groups)."""
    cg = channels // groups
    n = max(1, min(groups, 64 // cg))
    while groups % n:
        n -= 1
    return n


def pack_conv_weight(weight: Tensor, groups: int) -> Tensor:
    """A grouped Conv1d weight (C, C/groups, kernel) -> (G', kernel, L, L), contiguous: ``G' = groups / n``
    programs' block-diagonal weights of ``L = n · C/groups`` lanes, ``n`` = :func:`groups_per_program`."""
    c, cg, ks = weight.shape
    if c != cg * groups:
        raise ValueError(f"pack_conv_weight: a ({c}, {cg}, {ks}) weight is not {groups} groups of {c // groups}")
    n = groups_per_program(c, groups)
    w = weight.reshape(groups, cg, cg, ks).permute(0, 3, 2, 1)  # (group, tap, in, out)
    out = weight.new_zeros(groups // n, ks, n * cg, n * cg)
    for j in range(n):  # group j of a program owns the j-th diagonal block
        out[:, :, j * cg:(j + 1) * cg, j * cg:(j + 1) * cg] = w[j::n]
    return out.contiguous()


def causal_conv_mish(x: Tensor, weight: Tensor, bias: Tensor, frames: int, *, residual: Tensor | None = None,
                     out: Tensor | None = None) -> Tensor:
    """``Mish(conv(left_pad(x)) + bias) (+ residual)`` for x (B·T, C) channels-last rows of ``frames`` frames per
    batch row and a :func:`pack_conv_weight` weight (G, K, Cg, Cg); returns (B·T, C)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"causal_conv_mish: x must be a contiguous (B*T, C) tensor, got {tuple(x.shape)}")
    m, c = x.shape
    g, ks, cg, cg2 = weight.shape
    if cg != cg2 or g * cg != c or bias.shape != (c,) or not weight.is_contiguous():
        raise ValueError(f"causal_conv_mish: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not pack "
                         f"a grouped conv over {c} channels (use pack_conv_weight)")
    if weight.dtype != x.dtype:
        raise ValueError(f"causal_conv_mish: weight is {weight.dtype}, rows are {x.dtype}; cast one of them")
    if frames <= 0 or m % frames:
        raise ValueError(f"causal_conv_mish: {m} rows do not split into batch rows of {frames} frames")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"causal_conv_mish: residual must be contiguous {tuple(x.shape)}")
    out = torch.empty_like(x) if out is None else out
    bc = max(16, triton.next_power_of_2(cg))
    bt = 128 if interpreting() else (64 if bc <= 64 else 32)  # the interpreter pays per program
    grid = (triton.cdiv(frames, bt), m // frames, g)
    _causal_conv_kernel[grid](x, weight, bias, residual if residual is not None else x, out, frames, c, cg, ks,
                              HAS_RES=residual is not None, IEEE=x.dtype == torch.float32, BT=bt, BC=bc,
                              num_warps=4, num_stages=2)
    return out


def position_embedding_reference(x: Tensor, conv1: torch.nn.Conv1d, conv2: torch.nn.Conv1d, frames: int) -> Tensor:
    """``x + Mish(conv2(pad(Mish(conv1(pad(x))))))`` in PyTorch for (B·T, C) rows (for tests)."""
    import torch.nn.functional as F

    k = conv1.kernel_size[0]
    y = F.pad(x.view(-1, frames, x.shape[1]).transpose(1, 2), (k - 1, 0))
    y = F.pad(F.mish(conv1(y)), (k - 1, 0))
    return (F.mish(conv2(y)).transpose(1, 2).reshape_as(x) + x)
