"""HiFT's 1-D convolutions as one Triton kernel each, with their element-wise neighbours in the epilogue.

At a first chunk (one row, 50 mel frames) HiFT is launch- and latency-bound, and most of its kernels sit around
its ~80 convolutions rather than in them: per cuDNN convolution one or two layout or TF32-conversion passes
(``convertTensor``, ``nchwToNhwc``, ``nhwcAddPadding``), and per residual unit two
:func:`~cosyvoice_fast.vocoder.kernels.hift_snake.snake_pass` launches; the f0 predictor's five fp32 convolutions run a
small-tile CUDA-core kernel that leaves most of the GPU idle at 50 frames (measured on an H100).

:func:`conv1d` computes ``y = conv(pre(x)) + bias`` as an implicit GEMM: a program owns a (time, output channel)
tile and accumulates ``x[t·stride + j·dilation - padding, ci] · w[j, ci, co]`` over taps ``j`` and input-channel
blocks with ``tl.dot`` (zero padding outside the input).  Its epilogue can then apply, in this order, ELU, a
residual add, store that sum, and store the Snake activation of it with the *next* unit's frequency, so a Snake
residual unit is two launches (``conv1`` + bias + Snake, then ``conv2`` + bias + residual + the next Snake)
instead of two convolutions, two passes and cuDNN's conversions.

Precision: TF32 tensor-core products with fp32 accumulation where cuDNN's own convolutions would use TF32
(``torch.backends.cudnn.allow_tf32``, on by default), full fp32 products where not, and always for the f0
predictor (its output is integrated into a phase).  Any (B, C, T) strides are read and written, so
channel-major and time-major tensors both work; the filter network keeps its activations time-major (channels
contiguous), which makes every tile load a run of contiguous channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor, nn
from torch.nn.utils import parametrize

#: minimum programs per launch the tile choice aims for (the H100 has 132 SMs): a first chunk is one row of a
#: few hundred to a few thousand steps, so large tiles would leave most of the GPU idle
MIN_PROGRAMS = 132


@dataclass(frozen=True)
class ConvTiles:
    """The largest tiles (time steps, input and output channels per program), software-pipeline stages and
    warps; ``bci_narrow``: the input-channel block of time tiles of at most 32 steps (a wider block halves the
    serial loop of a wide conv at little shared memory)."""

    bt: int = 128
    bci: int = 64
    bci_narrow: int = 128
    bco: int = 64
    stages: int = 3
    warps: int = 4


#: the tiles every conv launch uses unless given others
TILES = ConvTiles()
#: calls of more batch rows keep cuDNN's convolutions, which were faster at 4 and 16 rows on an H100: the fused
#: vocoder's default (``FusedVocoder(triton_max_rows=...)``), fixed when its graphs are captured
TRITON_MAX_ROWS = 1


def use_triton(rows: int, max_rows: int = TRITON_MAX_ROWS) -> bool:
    """Whether a call of ``rows`` batch rows runs the Triton convolutions (at most ``max_rows``)."""
    return rows <= max_rows


@triton.jit
def to_tf32(x):
    """``x`` rounded to TF32 (10 mantissa bits, to nearest, ties away: PTX's ``cvt.rna.tf32.f32``) in fp32
    storage, by integer ops, so the interpreter runs it too.  Tensor cores read the top 19 bits of an fp32
    operand (the rest is dropped, a truncation), so operands are rounded first, as cuDNN does in its
    conversion passes."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 4096) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def snake(z, a, eps, ROUND: tl.constexpr):
    """The model's Snake, ``z + sin(a z)^2 / (a + eps)``, of an fp32 tile with ``a`` broadcast along its channels;
    ``ROUND``: rounded to TF32 (:func:`to_tf32`) for a TF32 conv that reads it next."""
    s = tl.sin(z * a)
    act = z + (1.0 / (a + eps)) * (s * s)
    if ROUND:
        act = to_tf32(act)
    return act


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, res_ptr, alpha_ptr, sum_ptr, act_ptr,
                 T_in, T_out, C_in, C_out, sxb, sxc, sxt, syb, syc, syt,
                 stride, dilation, padding, slope, eps,
                 KS: tl.constexpr, LEAKY: tl.constexpr, ELU: tl.constexpr, HAS_RES: tl.constexpr,
                 WRITE_SUM: tl.constexpr, SNAKE: tl.constexpr, IEEE: tl.constexpr, ROUND_IN: tl.constexpr,
                 ROUND_ACT: tl.constexpr, BT: tl.constexpr, BCI: tl.constexpr,
                 BCO: tl.constexpr, STAGES: tl.constexpr):
    """Program (batch row, time tile, output-channel tile); ``w`` is packed (KS, C_in, C_out).  One loop over
    (tap, input-channel block) pairs, so the pipeliner prefetches the next tap's tiles."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    co = tl.program_id(2) * BCO + tl.arange(0, BCO)
    co_ok = co < C_out
    bias = tl.load(b_ptr + co, mask=co_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BT, BCO], dtype=tl.float32)
    x_row = x_ptr + b * sxb
    n_cb = tl.cdiv(C_in, BCI)
    for it in tl.range(0, KS * n_cb, num_stages=STAGES):
        j = it // n_cb
        ci = (it - j * n_cb) * BCI + tl.arange(0, BCI)
        ci_ok = ci < C_in
        src = t * stride + j * dilation - padding
        t_ok = (src >= 0) & (src < T_in) & (t < T_out)
        xt = tl.load(x_row + src[:, None].to(tl.int64) * sxt + ci[None, :] * sxc,
                     mask=t_ok[:, None] & ci_ok[None, :], other=0.0)
        if LEAKY:
            xt = tl.where(xt >= 0, xt, xt * slope)
        if ROUND_IN:
            xt = to_tf32(xt)
        wt = tl.load(w_ptr + (j * C_in + ci)[:, None] * C_out + co[None, :],
                     mask=ci_ok[:, None] & co_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc, input_precision="tf32")
    z = acc + bias[None, :]
    if ELU:
        z = tl.where(z > 0, z, tl.exp(z) - 1.0)
    m = (t < T_out)[:, None] & co_ok[None, :]
    off = b * syb + t[:, None].to(tl.int64) * syt + co[None, :] * syc
    if HAS_RES:
        z = tl.load(res_ptr + off, mask=m, other=0.0) + z
    if WRITE_SUM:
        tl.store(sum_ptr + off, z, mask=m)
    if SNAKE:
        a = tl.load(alpha_ptr + co, mask=co_ok, other=1.0).to(tl.float32)[None, :]
        tl.store(act_ptr + off, snake(z, a, eps, ROUND_ACT), mask=m)


def round_tf32(x: Tensor) -> Tensor:
    """A copy of fp32 ``x`` rounded to TF32 as :func:`to_tf32` rounds (what a TF32 product reads exactly)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 4096) & -8192).view(torch.float32)


def pack_weight(weight: Tensor, tf32: bool = False) -> Tensor:
    """A ``Conv1d`` weight (C_out, C_in, K) as the kernel reads it: (K, C_in, C_out), contiguous (a copy);
    ``tf32``: rounded to TF32 (for the TF32 products)."""
    if weight.dim() != 3:
        raise ValueError(f"pack_weight takes a Conv1d weight (C_out, C_in, K), got {tuple(weight.shape)}")
    w = weight.detach().permute(2, 1, 0).contiguous().float()
    return round_tf32(w) if tf32 else w


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def conv_tiles(rows: int, t_out: int, c_in: int, c_out: int, min_programs: int = MIN_PROGRAMS,
               tiles: ConvTiles = TILES) -> tuple[int, int, int]:
    """(BT, BCI, BCO): the largest tiles (up to ``tiles``) that still give about ``min_programs``
    programs, shrinking the time tile to 32 first, then the channel tile, then both to 16 (``tl.dot``'s
    minimum).  (Triton's interpreter runs programs one after another: there the fewest programs are fastest.)"""
    bci, bco, bt = _pow2(c_in, 16, tiles.bci), _pow2(c_out, 16, tiles.bco), _pow2(t_out, 16, tiles.bt)

    def programs() -> int:
        return rows * triton.cdiv(t_out, bt) * triton.cdiv(c_out, bco)

    while programs() < min_programs and bt > 32:
        bt //= 2
    while programs() < min_programs and bco > 32:
        bco //= 2
    while programs() < min_programs and (bt > 16 or bco > 16):
        if bt >= bco:
            bt //= 2
        else:
            bco //= 2
    if bt <= 32:
        bci = _pow2(c_in, 16, tiles.bci_narrow)
    return bt, bci, bco


def out_length(t_in: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output steps of a ``Conv1d`` (PyTorch's formula)."""
    return (t_in + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def tf32_products(ieee: bool | None) -> bool:
    """Whether a conv runs TF32 products: ``ieee`` given, its opposite; None follows
    ``torch.backends.cudnn.allow_tf32`` (TF32 where cuDNN's own convolutions would use it), read at each call,
    so a graph keeps what was set at its capture."""
    return torch.backends.cudnn.allow_tf32 if ieee is None else not ieee


def conv1d(x: Tensor, weight: Tensor, bias: Tensor, *, stride: int = 1, padding: int = 0, dilation: int = 1,
           leaky_slope: float | None = None, elu: bool = False, residual: Tensor | None = None,
           write_sum: bool = True, alpha: Tensor | None = None, ieee: bool | None = None, time_major: bool = True,
           input_rounded: bool = False, round_act: bool = False, eps: float = 1e-9, tiles: ConvTiles = TILES
           ) -> tuple[Tensor | None, Tensor | None]:
    """``z = conv1d(pre(x), w) + bias`` over an fp32 (B, C_in, T) tensor of any strides, with ``weight`` packed by
    :func:`pack_weight` (rounded to TF32 for TF32 products); then ``elu``, ``+ residual``; returns
    ``(z if write_sum, snake_alpha(z) if alpha)``.

    ``pre`` is ``leaky_relu(·, leaky_slope)`` when a slope is given (zero padding is applied after it, as
    ``conv(leaky_relu(x))`` pads).  Outputs are (B, C_out, T_out), time-major (strides (T·C, 1, C)) unless
    ``time_major=False``; ``residual`` may have any strides.  ``eps`` is the Snake's guard on ``1 / alpha``.
    ``ieee``: see :func:`tf32_products`.  With TF32 products the input is rounded to TF32 as it is read unless
    ``input_rounded`` (a producer rounded it: ``round_act``, or ``round_tf32`` of
    :func:`~cosyvoice_fast.vocoder.kernels.hift_snake.snake_pass`), and
    ``round_act`` stores the Snake output rounded, ready for the next conv; in full fp32 neither rounds."""
    if x.dim() != 3 or x.dtype != torch.float32:
        raise ValueError(f"conv1d takes a (B, C, T) fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    ks, c_in, c_out = weight.shape
    b, c, t_in = x.shape
    if c != c_in or not weight.is_contiguous():
        raise ValueError(f"conv1d: weight must be packed (K, {c}, C_out) by pack_weight, got {tuple(weight.shape)}")
    if bias.shape != (c_out,):
        raise ValueError(f"conv1d: bias must be ({c_out},), got {tuple(bias.shape)}")
    if alpha is None and not write_sum:
        raise ValueError("conv1d would store nothing: give alpha, write_sum=True, or both")
    t_out = out_length(t_in, ks, stride, padding, dilation)
    if t_out < 1:
        raise ValueError(f"conv1d: {t_in} input steps give no output (kernel {ks}, dilation {dilation}, "
                         f"padding {padding}, stride {stride})")

    def new() -> Tensor:
        if time_major:
            return torch.empty(b, t_out, c_out, device=x.device).transpose(1, 2)
        return torch.empty(b, c_out, t_out, device=x.device)

    total = new() if write_sum else None
    act = new() if alpha is not None else None
    like = total if total is not None else act
    res = like
    if residual is not None:
        if residual.shape != like.shape:
            raise ValueError(f"conv1d: residual shape {tuple(residual.shape)} differs from the output's "
                             f"{tuple(like.shape)}")
        res = residual if residual.stride() == like.stride() else torch.empty_like(like).copy_(residual)
    tf32 = tf32_products(ieee)
    bt, bci, bco = conv_tiles(b, t_out, c_in, c_out, MIN_PROGRAMS if x.is_cuda else 1, tiles)
    grid = (b, triton.cdiv(t_out, bt), triton.cdiv(c_out, bco))
    _conv_kernel[grid](x, weight, bias, res, alpha if alpha is not None else bias,
                       total if total is not None else like, act if act is not None else like,
                       t_in, t_out, c_in, c_out, *x.stride(), *like.stride(), stride, dilation, padding,
                       0.0 if leaky_slope is None else float(leaky_slope), eps,
                       KS=ks, LEAKY=leaky_slope is not None, ELU=elu, HAS_RES=residual is not None,
                       WRITE_SUM=write_sum, SNAKE=alpha is not None, IEEE=not tf32,
                       ROUND_IN=tf32 and not input_rounded, ROUND_ACT=tf32 and round_act, BT=bt, BCI=bci,
                       BCO=bco, STAGES=tiles.stages, num_warps=tiles.warps)
    return total, act


def packed(conv: nn.Module, tf32: bool = False) -> Tensor:
    """The conv's packed weight (``tf32``: rounded to TF32), made once and kept as a non-persistent buffer
    ``weight_kio`` / ``weight_kio_tf32`` (a copy: it goes stale if the weight changes, like
    :func:`~cosyvoice_fast.vocoder.model.hift.weight_4d`'s)."""
    name = "weight_kio_tf32" if tf32 else "weight_kio"
    w = getattr(conv, name, None)
    if w is None:
        if not isinstance(conv, nn.Conv1d) or conv.groups != 1 or parametrize.is_parametrized(conv):
            raise ValueError(f"conv1d runs plain Conv1d layers of one group (weight norm folded), not "
                             f"{type(conv).__name__}")
        conv.register_buffer(name, pack_weight(conv.weight, tf32=tf32), persistent=False)
        w = getattr(conv, name)
    return w


def run_conv(conv: nn.Conv1d, x: Tensor, ieee: bool | None = None, **kw) -> tuple[Tensor | None, Tensor | None]:
    """:func:`conv1d` with a ``Conv1d`` module's own weight (packed once per precision), bias, stride, padding
    and dilation."""
    if conv.bias is None:
        raise ValueError("conv1d needs a conv with a bias")
    tf32 = tf32_products(ieee)
    return conv1d(x, packed(conv, tf32=tf32), conv.bias, stride=conv.stride[0], padding=conv.padding[0],
                  dilation=conv.dilation[0], ieee=not tf32, **kw)


def f0_fused(predictor: nn.Module, mel: Tensor) -> Tensor:
    """:class:`~cosyvoice_fast.vocoder.model.source.F0Predictor` with each conv + ELU one full-fp32 launch (its
    weights folded: no weight norm); the per-frame read-out and ``abs`` stay PyTorch.  (B, n_mels, T) -> (B, T)."""
    convs = [m for m in predictor.condnet if isinstance(m, nn.Conv1d)]
    if len(convs) != len(predictor.condnet) // 2 or any(parametrize.is_parametrized(c) for c in convs):
        raise ValueError("f0_fused needs the folded predictor (plain Conv1d layers), as remove_weight_norm makes")
    h = mel.float()
    for conv in convs:
        h, _ = run_conv(conv, h, elu=True, ieee=True)
    return predictor.classifier(h.transpose(1, 2)).squeeze(-1).abs()
