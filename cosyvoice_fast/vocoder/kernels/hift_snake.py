"""HiFT's residual units with the Snake activations, conv biases and residual adds fused into one Triton pass each.

A :class:`~cosyvoice_fast.vocoder.model.hift.SnakeResBlock` unit is ``x + conv2(snake(conv1(snake(x))))``.  Run by
PyTorch, each Snake is about six elementwise kernels (``a + eps``, reciprocal, ``x * a``, ``sin``, ``pow``,
multiply-add), each conv adds its bias in a pass of its own, and the residual add is one more: about 17 kernels
around the two convolutions, each reading and writing the whole activation.  In the captured vocoder that is
over half of its ~1000 kernels and, at 16 rows, about half of its GPU time (profiled on an H100).

Here each unit is the two convolutions (cuDNN, no bias) and two passes of :func:`snake_pass`:

* after ``conv1``: ``snake(t + b1)``;
* after ``conv2``: ``x + t + b2`` (the unit's output) and, in the same pass, the next unit's ``snake`` of it.

Math in fp32 with the model's formula, ``z + sin(a z)^2 / (a + eps)``; the only differences from the eager
module are the order of the bias and residual additions and the sine's implementation (float rounding).  The
fused blocks read the plain (weight-norm folded) model's parameters; they hold no state of their own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn
from torch.nn.utils import parametrize

from cosyvoice_fast.vocoder.model.hift import Snake, SnakeResBlock, conv_time_major, weight_4d
from cosyvoice_fast.vocoder.kernels.hift_conv import (
    TRITON_MAX_ROWS, packed, run_conv, snake, tf32_products, use_triton,
)


@triton.jit
def _snake_pass_kernel(x_ptr, bias_ptr, res_ptr, alpha_ptr, sum_ptr, act_ptr, C, T, sb, sc, st, eps,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_SUM: tl.constexpr,
                       SNAKE: tl.constexpr, ROUND: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Program (batch row, channel block, time block) of (B, C, T) tensors that share the strides ``sb, sc, st``
    (channel-major or time-major: whichever stride is 1 is the contiguous direction of the tile)."""
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    t = tl.program_id(2) * BT + tl.arange(0, BT)
    m = (ch < C)[:, None] & (t < T)[None, :]
    off = b.to(tl.int64) * sb + ch[:, None] * sc + t[None, :].to(tl.int64) * st
    z = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + ch, mask=ch < C, other=0.0).to(tl.float32)[:, None]
    if HAS_RES:
        z = tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32) + z
    if WRITE_SUM:
        tl.store(sum_ptr + off, z, mask=m)
    if SNAKE:
        a = tl.load(alpha_ptr + ch, mask=ch < C, other=1.0).to(tl.float32)[:, None]
        tl.store(act_ptr + off, snake(z, a, eps, ROUND), mask=m)


def _dense(x: Tensor) -> Tensor:
    """``x`` itself when channel-major or time-major (the layouts the kernel's tiles read), else a
    channel-major copy."""
    b, c, t = x.shape
    if x.stride() in ((c * t, t, 1), (c * t, 1, c)):
        return x
    return x.contiguous()


def snake_pass(x: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, alpha: Tensor | None = None,
               write_sum: bool = False, round_tf32: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """``z = x + bias + residual`` over an fp32 (B, C, T) tensor (bias per channel), then
    ``(z if write_sum, snake_alpha(z) if alpha is given)``, in one pass.  Channel-major and time-major
    (:func:`~cosyvoice_fast.vocoder.model.hift.time_major`) inputs keep their layout in the outputs.  ``round_tf32``:
    the Snake output rounded to TF32 (it feeds a TF32 conv of :mod:`.hift_conv` only)."""
    if x.dim() != 3 or x.dtype != torch.float32:
        raise ValueError(f"snake_pass takes a (B, C, T) fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    if alpha is None and not write_sum:
        raise ValueError("snake_pass would compute nothing: give alpha, write_sum=True, or both")
    x = _dense(x)
    b, c, t = x.shape
    res = x
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from the input's {tuple(x.shape)}")
        res = residual if residual.stride() == x.stride() else torch.empty_like(x).copy_(residual)
    total = torch.empty_like(x) if write_sum else None
    act = torch.empty_like(x) if alpha is not None else None
    time_major = x.stride(1) == 1 and c > 1
    bc, bt = (64, 64) if time_major else (4, min(1024, max(128, triton.next_power_of_2(t))))
    grid = (b, triton.cdiv(c, bc), triton.cdiv(t, bt))
    _snake_pass_kernel[grid](x, bias if bias is not None else x, res, alpha if alpha is not None else x,
                             total if total is not None else x, act if act is not None else x, c, t,
                             x.stride(0), x.stride(1), x.stride(2), Snake.EPS,
                             HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_SUM=write_sum,
                             SNAKE=alpha is not None, ROUND=round_tf32, BC=bc, BT=bt, num_warps=4)
    return total, act


class FusedSnakeResBlock(nn.Module):
    """The same residual units as ``block`` (a weight-norm-free :class:`SnakeResBlock`, whose parameters it
    reads, not copies): per unit two bias-free convolutions and two :func:`snake_pass` calls; or, with
    ``triton_convs``, two :func:`~cosyvoice_fast.vocoder.kernels.hift_conv.conv1d` launches whose epilogues add the bias,
    the residual and the next Snake (one :func:`snake_pass` per block remains, the first unit's Snake), for calls of
    at most ``triton_max_rows`` batch rows."""

    def __init__(self, block: SnakeResBlock, triton_convs: bool = False, triton_max_rows: int = TRITON_MAX_ROWS):
        super().__init__()
        for conv in (*block.convs1, *block.convs2):
            if parametrize.is_parametrized(conv) or conv.bias is None:
                raise ValueError("FusedSnakeResBlock needs plain conv weights with biases: fold the weight norm "
                                 "first (HiFTGenerator.remove_weight_norm)")
        self.block = block
        self.triton_convs = triton_convs
        self.triton_max_rows = triton_max_rows

    def forward(self, x: Tensor) -> Tensor:
        blk = self.block
        units = list(zip(blk.activations1, blk.convs1, blk.activations2, blk.convs2))
        x = _dense(x.float())
        if self.triton_convs and use_triton(x.shape[0], self.triton_max_rows):
            tf32 = tf32_products(None)  # every Snake output feeds a conv only: stored rounded for TF32 products
            kw = {"ieee": not tf32, "input_rounded": True, "round_act": True, "eps": Snake.EPS}
            _, y = snake_pass(x, alpha=units[0][0].alpha, round_tf32=tf32)
            for i, (_, c1, act2, c2) in enumerate(units):
                _, t = run_conv(c1, y, write_sum=False, alpha=act2.alpha, **kw)
                nxt = units[i + 1][0].alpha if i + 1 < len(units) else None
                x, y = run_conv(c2, t, residual=x, alpha=nxt, **kw)
            return x
        _, y = snake_pass(x, alpha=units[0][0].alpha)
        for i, (_, c1, act2, c2) in enumerate(units):
            t = self._conv(c1, y)
            _, t = snake_pass(t, bias=c1.bias, alpha=act2.alpha)
            t = self._conv(c2, t)
            nxt = units[i + 1][0].alpha if i + 1 < len(units) else None
            x, y = snake_pass(t, bias=c2.bias, residual=x, alpha=nxt, write_sum=True)
        return x

    @staticmethod
    def _conv(conv: nn.Module, x: Tensor) -> Tensor:
        """The bias-free convolution: time-major through its 4-D weight when it has one and ``x`` is
        time-major, else :func:`torch.nn.functional.conv1d`."""
        w4 = getattr(conv, "weight4", None)
        if w4 is not None and x.stride(1) == 1 and x.shape[1] > 1:
            return conv_time_major(conv, w4, x, bias=False)
        return F.conv1d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation)


def fuse_hift(plain: nn.Module, time_major: bool = True, triton_convs: bool = False,
              triton_max_rows: int = TRITON_MAX_ROWS) -> int:
    """Swap every :class:`SnakeResBlock` of a weight-norm-folded HiFT (``remove_weight_norm()``'s copy, owned by
    the caller) for a :class:`FusedSnakeResBlock` in place, and set its ``time_major`` layout (see
    :func:`~cosyvoice_fast.vocoder.model.hift.time_major`; with it every convolution gets a ``weight4`` buffer, a copy
    of its weight made here); returns how many blocks were swapped.

    ``triton_convs`` (needs ``time_major``): every ``Conv1d`` of the filter network runs as
    :func:`~cosyvoice_fast.vocoder.kernels.hift_conv.conv1d` (its packed weight made here), through the model's
    ``conv_override`` and the fused residual units, for calls of at most ``triton_max_rows`` batch rows (more
    keep cuDNN's time-major path); the transposed convolutions stay cuDNN's."""
    if triton_convs and not time_major:
        raise ValueError("fuse_hift: triton_convs runs the conv stack time-major; pass time_major=True")
    plain.time_major = time_major
    parts = (plain.conv_pre, plain.ups, plain.source_downs, plain.resblocks, plain.source_resblocks,
             plain.conv_post)
    convs = [m for part in parts for m in part.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    if time_major:  # every convolution of the filter network (not f0's) gets its 4-D channels-last weight
        for conv in convs:
            if not hasattr(conv, "weight4"):
                conv.register_buffer("weight4", weight_4d(conv), persistent=False)
    if triton_convs:  # packed now, never inside a graph capture: both precisions, the f0 predictor's full fp32
        for conv in convs:
            if isinstance(conv, nn.Conv1d):
                packed(conv, tf32=False)
                packed(conv, tf32=True)
        for conv in plain.f0_predictor.condnet:
            if isinstance(conv, nn.Conv1d):
                packed(conv, tf32=False)
        plain.conv_override = functools.partial(_triton_conv, max_rows=triton_max_rows)
    n = 0
    for lists in (plain.resblocks, plain.source_resblocks):
        for i, blk in enumerate(lists):
            if isinstance(blk, SnakeResBlock):
                lists[i] = FusedSnakeResBlock(blk, triton_convs=triton_convs, triton_max_rows=triton_max_rows)
                n += 1
    return n


def _triton_conv(conv: nn.Conv1d, x: Tensor, max_rows: int = TRITON_MAX_ROWS) -> Tensor:
    """``conv(x)`` as one :func:`~cosyvoice_fast.vocoder.kernels.hift_conv.conv1d` launch, time-major out; calls of more
    than ``max_rows`` rows take cuDNN's time-major path."""
    if not use_triton(x.shape[0], max_rows):
        return conv_time_major(conv, conv.weight4, x)
    y, _ = run_conv(conv, x.float())
    return y
