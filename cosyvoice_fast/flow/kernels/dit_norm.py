"""Triton AdaLN-Zero glue of CosyVoice3's DiT: the gated residual and the modulated LayerNorm in one pass.

Eager PyTorch spends about six elementwise launches per LayerNorm site (``x + gate · y``, the norm,
``1 + scale``, the product, ``+ shift``) on rows of 1024 channels: at one request's 2 x 112 frames each is a
~2 µs launch doing nanoseconds of work, and the DiT has 45 such sites a forward.  Here one program owns one
frame's whole row (under the CPU interpreter, 32 rows), so a site is one launch:

``x ← x + gate · y`` (optional, in place: the residual stream), then ``h = LN(x) · (1 + scale) + shift``
(LayerNorm without affine, eps 1e-6, statistics in fp32; the LN reads the *stored* residual, rounded to the
stream's dtype, as eager reads it).

Modulation vectors (shift / scale / gate, each ``D`` wide) are columns of a row of ``mods`` (R, W):

* ``R == 1``: one row for every frame (the CFM's one flow time per call);
* ``R == B``: row ``m // frames`` (per-request times, as the eager DiT allows);
* ``sel`` given: the row whose index is ``sel[0]`` (a float step index: the modulation table a graph's Euler
  step reads, :meth:`~cosyvoice_fast.flow.kernels.dit_blas.BlasDiT.time_table`) -- no index_select launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import interpreting

MOD_SHARED, MOD_PER_ROW, MOD_SELECTED = 0, 1, 2


@triton.jit
def _ada_norm_kernel(x_ptr, y_ptr, mod_ptr, sel_ptr, h_ptr, M, D, T, mod_stride, gate_off, shift_off, scale_off, eps,
                     HAS_RES: tl.constexpr, MOD: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    if MOD == 2:
        mrow = rows * 0 + tl.load(sel_ptr).to(tl.float32).to(tl.int64)
    elif MOD == 1:
        mrow = rows // T
    else:
        mrow = rows * 0
    mods = mod_ptr + mrow[:, None] * mod_stride + cols[None, :]
    offs = rows[:, None] * D + cols[None, :]
    xdt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        g = tl.load(mods + gate_off, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        xs = (x + g * y).to(xdt)
        tl.store(x_ptr + offs, xs, mask=ok)
        x = xs.to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    sh = tl.load(mods + shift_off, mask=ok, other=0.0).to(tl.float32)
    sc = tl.load(mods + scale_off, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, (xc * rstd[:, None] * (1.0 + sc) + sh).to(h_ptr.dtype.element_ty), mask=ok)


def _mod_mode(mods: Tensor, rows: int, frames: int, sel: Tensor | None) -> int:
    if mods.dim() != 2 or mods.stride(1) != 1:
        raise ValueError(f"modulated_norm: mods must be (R, W) with unit column stride, got {tuple(mods.shape)}")
    if sel is not None:
        return MOD_SELECTED
    if mods.shape[0] == 1:
        return MOD_SHARED
    if mods.shape[0] * frames == rows:
        return MOD_PER_ROW
    raise ValueError(f"modulated_norm: {mods.shape[0]} modulation rows for {rows // frames} batch rows "
                     f"of {frames} frames (give 1 shared row, one per batch row, or sel)")


def modulated_norm(x: Tensor, mods: Tensor, shift: int, scale: int, frames: int, *, y: Tensor | None = None,
                   gate: int = 0, sel: Tensor | None = None, out: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``h = LN(x) · (1 + mods[:, scale:scale+D]) + mods[:, shift:shift+D]`` for x (M, D) rows of ``frames``
    frames per batch row; with ``y`` first ``x += mods[:, gate:gate+D] · y`` in place.  Returns ``h`` (``out``
    or a new (M, D) tensor)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"modulated_norm: x must be a contiguous (M, D) tensor, got {tuple(x.shape)}")
    m, d = x.shape
    if frames <= 0 or m % frames:
        raise ValueError(f"modulated_norm: {m} rows do not split into batch rows of {frames} frames")
    if y is not None and (y.shape != x.shape or not y.is_contiguous()):
        raise ValueError(f"modulated_norm: y must be contiguous {tuple(x.shape)}, got {tuple(y.shape)}")
    mode = _mod_mode(mods, m, frames, sel)
    for name, off in (("shift", shift), ("scale", scale), ("gate", gate)):
        if off < 0 or off + d > mods.shape[1]:
            raise ValueError(f"modulated_norm: {name} columns {off}..{off + d} outside the {mods.shape[1]} of mods")
    out = torch.empty_like(x) if out is None else out
    bm = 32 if interpreting() else 1  # the interpreter pays per program; a GPU wants every SM busy
    _ada_norm_kernel[(triton.cdiv(m, bm),)](
        x, y if y is not None else x, mods, sel if sel is not None else mods, out, m, d, frames, mods.stride(0),
        gate, shift, scale, float(eps), HAS_RES=y is not None, MOD=mode, BM=bm,
        BD=max(16, triton.next_power_of_2(d)), num_warps=4 if d <= 2048 else 8)
    return out


def modulated_norm_reference(x: Tensor, mods: Tensor, shift: int, scale: int, frames: int, *,
                             y: Tensor | None = None, gate: int = 0, sel: Tensor | None = None,
                             eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """What :func:`modulated_norm` computes, in PyTorch (for tests): ``(h, new x)``, ``x`` left untouched."""
    m, d = x.shape
    if sel is not None:
        rows = mods[int(sel.reshape(-1)[0].item())].unsqueeze(0).expand(m, -1)
    elif mods.shape[0] == 1:
        rows = mods.expand(m, -1)
    else:
        rows = mods.repeat_interleave(frames, dim=0)
    rows = rows.float()
    xf = x.float()
    if y is not None:
        xf = (xf + rows[:, gate:gate + d] * y.float()).to(x.dtype).float()
    h = torch.nn.functional.layer_norm(xf, (d,), eps=eps) * (1 + rows[:, scale:scale + d]) + rows[:, shift:shift + d]
    return h.to(x.dtype), xf.to(x.dtype)
