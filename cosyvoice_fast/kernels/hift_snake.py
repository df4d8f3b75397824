"""HiFT's residual units with the Snake activations, conv biases and residual adds fused into one Triton pass each.

A :class:`~cosyvoice_fast.models.hift.SnakeResBlock` unit is ``x + conv2(snake(conv1(snake(x))))``.  Run by
PyTorch, each Snake is about six elementwise kernels (``a + eps``, reciprocal, ``x * a``, ``sin``, ``pow``,
multiply-add), each conv adds its bias in a pass of its own, and the residual add is one more: about 17 kernels
around the two convolutions, each reading and writing the whole activation.  In the captured vocoder that is
over half of its ~1000 kernels and, at 16 rows, about half of its GPU time (BENCHMARKS.md, HiFT profile).

Here each unit is the two convolutions (cuDNN, no bias) and two passes of :func:`snake_pass`:

* after ``conv1``: ``snake(t + b1)``;
* after ``conv2``: ``x + t + b2`` (the unit's output) and, in the same pass, the next unit's ``snake`` of it.

Math in fp32 with the model's formula, ``z + sin(a z)^2 / (a + eps)``; the only differences from the eager
module are the order of the bias and residual additions and the sine's implementation (float rounding).  The
fused blocks read the plain (weight-norm folded) model's parameters; they hold no state of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor, nn

from ..models.hift import Snake, SnakeResBlock


@triton.jit
def _snake_pass_kernel(x_ptr, bias_ptr, res_ptr, alpha_ptr, sum_ptr, act_ptr, C, T, eps,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_SUM: tl.constexpr,
                       SNAKE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one (batch, channel) row of a contiguous (B, C, T) tensor
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = t < T
    off = row.to(tl.int64) * T + t
    ch = row % C
    z = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z = z + tl.load(bias_ptr + ch).to(tl.float32)
    if HAS_RES:
        z = tl.load(res_ptr + off, mask=m, other=0.0).to(tl.float32) + z
    if WRITE_SUM:
        tl.store(sum_ptr + off, z, mask=m)
    if SNAKE:
        a = tl.load(alpha_ptr + ch).to(tl.float32)
        s = tl.sin(z * a)
        tl.store(act_ptr + off, z + (1.0 / (a + eps)) * (s * s), mask=m)


def snake_pass(x: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, alpha: Tensor | None = None,
               write_sum: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """``z = x + bias + residual`` over a contiguous fp32 (B, C, T) tensor (bias per channel), then
    ``(z if write_sum, snake_alpha(z) if alpha is given)``, in one pass."""
    if x.dim() != 3 or x.dtype != torch.float32:
        raise ValueError(f"snake_pass takes a (B, C, T) fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    if alpha is None and not write_sum:
        raise ValueError("snake_pass would compute nothing: give alpha, write_sum=True, or both")
    x = x.contiguous()
    b, c, t = x.shape
    res = residual.contiguous() if residual is not None else x
    if res.shape != x.shape:
        raise ValueError(f"residual shape {tuple(res.shape)} differs from the input's {tuple(x.shape)}")
    total = torch.empty_like(x) if write_sum else None
    act = torch.empty_like(x) if alpha is not None else None
    block = min(2048, max(128, triton.next_power_of_2(t)))
    grid = (b * c, triton.cdiv(t, block))
    _snake_pass_kernel[grid](x, bias if bias is not None else x, res, alpha if alpha is not None else x,
                             total if total is not None else x, act if act is not None else x, c, t, Snake.EPS,
                             HAS_BIAS=bias is not None, HAS_RES=residual is not None, WRITE_SUM=write_sum,
                             SNAKE=alpha is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return total, act


class FusedSnakeResBlock(nn.Module):
    """The same residual units as ``block`` (a weight-norm-free :class:`SnakeResBlock`, whose parameters it
    reads, not copies): per unit two bias-free convolutions and two :func:`snake_pass` calls."""

    def __init__(self, block: SnakeResBlock):
        super().__init__()
        for conv in (*block.convs1, *block.convs2):
            if not isinstance(conv.weight, nn.Parameter) or conv.bias is None:
                raise ValueError("FusedSnakeResBlock needs plain conv weights with biases: fold the weight norm "
                                 "first (HiFTGenerator.remove_weight_norm)")
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        blk = self.block
        units = list(zip(blk.activations1, blk.convs1, blk.activations2, blk.convs2))
        x = x.float().contiguous()
        _, y = snake_pass(x, alpha=units[0][0].alpha)
        for i, (_, c1, act2, c2) in enumerate(units):
            t = F.conv1d(y, c1.weight, None, c1.stride, c1.padding, c1.dilation)
            _, t = snake_pass(t, bias=c1.bias, alpha=act2.alpha)
            t = F.conv1d(t, c2.weight, None, c2.stride, c2.padding, c2.dilation)
            nxt = units[i + 1][0].alpha if i + 1 < len(units) else None
            x, y = snake_pass(t, bias=c2.bias, residual=x, alpha=nxt, write_sum=True)
        return x


def fuse_hift(plain: nn.Module) -> int:
    """Swap every :class:`SnakeResBlock` of a weight-norm-folded HiFT (``remove_weight_norm()``'s copy, owned by
    the caller) for a :class:`FusedSnakeResBlock` in place; returns how many were swapped."""
    n = 0
    for lists in (plain.resblocks, plain.source_resblocks):
        for i, blk in enumerate(lists):
            if isinstance(blk, SnakeResBlock):
                lists[i] = FusedSnakeResBlock(blk)
                n += 1
    return n
