"""The decode graph's input merge and input advance (:class:`..backends.decode_feed.StepFeed`) as one launch each.

Each is a handful of integer selects over a few int64 columns: as torch operations the merge is five launches
and the advance nine (add, clamp, casts, concatenation, select, copy), about a tenth of a one-row decode
step's launches outside the decoder.  One program per slot column does either here; integer arithmetic, so
the results are the torch path's exactly (the CPU tests run both through the interpreter and compare).

Column layout (``step_in``, one column per slot, rows in this order): the token to feed, its position, the
generator's seed and offset, then the last W history tokens, oldest first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rows of a step_in column, as :mod:`..backends.decode_feed` lays them out (a test keeps the two equal); the
# kernels read them as compile-time constants
TOKEN, POS, SEED, OFFSET, WINDOW = 0, 1, 2, 3, 4
_TOKEN, _POS, _OFFSET, _WINDOW = (tl.constexpr(v) for v in (TOKEN, POS, OFFSET, WINDOW))


@triton.jit
def _read_kernel(staged_ptr, inp_ptr, pos_ptr, live_ptr, R, stride_s, stride_i, max_len,
                 BLOCK_R: tl.constexpr):
    col = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    ok = r < R
    fresh = tl.load(staged_ptr + R * stride_s + col) != 0
    new = tl.where(fresh, tl.load(staged_ptr + r * stride_s + col, mask=ok, other=0),
                   tl.load(inp_ptr + r * stride_i + col, mask=ok, other=0))
    pos = tl.where(fresh, tl.load(staged_ptr + _POS * stride_s + col), tl.load(inp_ptr + _POS * stride_i + col))
    live = tl.load(staged_ptr + (R + 1) * stride_s + col) != 0
    tl.debug_barrier()  # every lane's loads of the column before any lane's store into it
    tl.store(inp_ptr + r * stride_i + col, new, mask=ok)
    tl.store(pos_ptr + col, tl.where(live, pos, max_len - 1))
    tl.store(live_ptr + col, live.to(tl.uint8))


@triton.jit
def _advance_kernel(inp_ptr, drawn_ptr, live_ptr, ring_ptr, R, stride_i, stride_d, stride_rd, stride_rf, depth,
                    max_len, draw_offset, BLOCK_R: tl.constexpr, HAS_RING: tl.constexpr):
    col = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    token = tl.load(drawn_ptr + col)
    fallback = tl.load(drawn_ptr + stride_d + col)
    ok = (r < R) & (tl.load(live_ptr + col + r * 0) != 0)  # the flag as a block: a mask must be one
    old = tl.load(inp_ptr + r * stride_i + col, mask=ok, other=0)
    later = tl.load(inp_ptr + (r + 1) * stride_i + col, mask=ok & (r >= _WINDOW) & (r < R - 1), other=0)
    pos = tl.load(inp_ptr + _POS * stride_i + col)
    offset = tl.load(inp_ptr + _OFFSET * stride_i + col)
    new = tl.where(r >= _WINDOW, tl.where(r == R - 1, token, later), old)  # the window, shifted by the token
    new = tl.where(r == _TOKEN, token, new)
    new = tl.where(r == _POS, tl.minimum(pos + 1, max_len - 1), new)
    new = tl.where(r == _OFFSET, offset + draw_offset * (1 + fallback), new)
    tl.debug_barrier()  # the column is read whole before it is rewritten in place
    tl.store(inp_ptr + r * stride_i + col, new, mask=ok)
    if HAS_RING:  # the step's result where the host reads it: entry pos % depth of the column's ring
        live = (tl.load(live_ptr + col) != 0) & (pos >= 0)  # (a step's position never is negative)
        entry = ring_ptr + (pos % depth) * stride_rd + col
        tl.store(entry, token, mask=live)
        tl.store(entry + stride_rf, fallback, mask=live)
        tl.store(entry + 2 * stride_rf, pos, mask=live)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")


def read_columns(staged: torch.Tensor, inp: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the fresh columns of ``staged`` (R + 2, n: R input rows, then the fresh and live flags) into
    ``inp`` (R, n, in place) and return the step's positions (n, 1; ``max_len - 1`` where not live) and live
    flags (n,) bool."""
    rows, n = inp.shape
    _check("staged", staged, (rows + 2, n), torch.int64)
    if inp.dtype != torch.int64 or inp.stride(1) != 1 or staged.stride(1) != 1:
        raise ValueError("step_in and staged must be int64 with unit stride along slots")
    pos = torch.empty(n, 1, dtype=torch.int64, device=inp.device)
    live = torch.empty(n, dtype=torch.bool, device=inp.device)
    if n:
        _read_kernel[(n,)](staged, inp, pos, live.view(torch.uint8), rows, staged.stride(0), inp.stride(0), max_len,
                           BLOCK_R=triton.next_power_of_2(rows), num_warps=1)
    return pos, live


def advance_columns(inp: torch.Tensor, drawn: torch.Tensor, live: torch.Tensor, max_len: int,
                    draw_offset: int, ring: torch.Tensor | None = None) -> None:
    """Advance each live column of ``inp`` (R, n) past its step: the drawn token (``drawn[0]``), the next
    position (kept below ``max_len``), the offset past the step's one draw or two (``drawn[1]`` = 1), the
    window shifted by the token.  With ``ring`` ((D, 3, >= n) int64, on the host where the GPU can write it:
    pinned), also write each live column's token, fallback flag and position at ``ring[pos % D, :, col]``."""
    rows, n = inp.shape
    _check("drawn", drawn, (2, n), torch.int64)
    _check("live", live, (n,), torch.bool)
    if ring is not None and (ring.dim() != 3 or ring.shape[1] != 3 or ring.shape[2] < n or ring.dtype != torch.int64
                             or ring.stride(2) != 1):
        raise ValueError(f"ring must be (D, 3, >= {n}) int64 with unit stride along slots, got "
                         f"{tuple(ring.shape)} {ring.dtype} strides {ring.stride()}")
    if inp.dtype != torch.int64 or inp.stride(1) != 1 or drawn.stride(1) != 1:
        raise ValueError("step_in and drawn must be int64 with unit stride along slots")
    if rows < WINDOW:
        raise ValueError(f"step_in must have at least {WINDOW} rows (token, position, seed, offset), got {rows}")
    if n:
        args = (ring, ring.stride(0), ring.stride(1), ring.shape[0]) if ring is not None else (inp, 0, 0, 1)
        _advance_kernel[(n,)](inp, drawn, live.view(torch.uint8), args[0], rows, inp.stride(0), drawn.stride(0),
                              *args[1:], max_len, draw_offset, BLOCK_R=triton.next_power_of_2(rows),
                              HAS_RING=ring is not None, num_warps=1)
