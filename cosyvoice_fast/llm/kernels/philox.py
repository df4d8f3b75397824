"""``Tensor.exponential_`` of a CUDA generator, computed from its seed and offset inside a graph.

The decode graph needs the exponential variates of each row's draws (:mod:`..backends.nucleus`), and the
repetition-aware fallback needs another set whose generator offset depends on whether the step's nucleus
token repeats.  Drawing them eagerly from each request's generator costs one launch per row and step, and the
fallback one more launch and a host sync; here they are recomputed on the device from ``(seed, offset)``, the
two numbers a CUDA generator's state is, so nothing per row runs on the host but two integers.

What a CUDA ``exponential_`` of ``n <= 8192`` fp32 elements does (torch's Philox path): it takes the generator's
offset ``o`` (a multiple of 4) and advances it by 4; element ``i`` is the first 32-bit word ``x`` of
Philox4x32-10 with key ``(seed lo, seed hi)`` and counter ``(o/4 lo, o/4 hi, i lo, i hi)`` (curand's
subsequence ``i``, offset ``o``), made uniform as ``u = x * 2**-32 + 2**-33`` in fp32 and then ``-log(u)``
with CUDA's fast ``__logf`` (``lg2.approx`` times ln 2 rounded to fp32), except ``u >= 1 - 2**-24``, which gives
``2**-24``.  The GPU tests compare this kernel with ``exponential_`` bit for bit.  Under the Triton
interpreter (CPU) ``lg2.approx`` is not available and ``log2`` stands in: the integer part is exact there,
the float part within an ulp or two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.common import interpreting

# Philox4x32 multipliers and Weyl key increments (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3")
_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)
#: the element count up to which torch gives every element its own thread (256-thread blocks, the grid capped
#: at SMs x 8 blocks), so element i is thread i's first word on any GPU with at least 4 SMs; past that torch's
#: mapping depends on the GPU (the speech vocabulary is 6564)
MAX_ELEMENTS = 8192
#: how far one ``exponential_`` of up to :data:`MAX_ELEMENTS` elements advances a CUDA generator's offset
DRAW_OFFSET = 4


@triton.jit
def _philox_x(c0, c1, c2, c3, k0, k1):
    """The first output word of Philox4x32-10 (ten rounds, the key bumped after each)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0


@triton.jit
def philox_words(seed, offset, cols):
    """The Philox words of elements ``cols`` (int, any shape) of a draw at generator state ``(seed, offset)``
    (int64 scalars: the seed's bits and the offset, the latter already moved past earlier draws)."""
    quad = offset >> 2  # the counter advances once per 4 offsets
    zero = tl.zeros(cols.shape, dtype=tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32) + zero
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) + zero
    c0 = (quad & 0xFFFFFFFF).to(tl.uint32) + zero
    c1 = ((quad >> 32) & 0xFFFFFFFF).to(tl.uint32) + zero
    return _philox_x(c0, c1, cols.to(tl.uint32), zero, k0, k1)


@triton.jit
def exponential_at(seed, offset, cols, FAST_LOG: tl.constexpr):
    """``exponential_``'s fp32 variates ``cols`` at generator state ``(seed, offset)`` (see
    :func:`philox_words`): what the kernels that draw with them compute in place of reading a buffer."""
    u = philox_words(seed, offset, cols).to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    if FAST_LOG:  # x * 2**-32 + 2**-33 above; CUDA's __logf below
        lg = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                       pack=1)
    else:
        lg = tl.log2(u)
    return -tl.where(u >= 0.99999994039535522, -5.9604644775390625e-08, lg * 0.693147182464599609375)


@triton.jit
def _exponential_kernel(state_ptr, out_ptr, n, stride_state, stride_out, delta, BLOCK: tl.constexpr,
                        FAST_LOG: tl.constexpr, RAW: tl.constexpr):
    """Row ``r``: seed ``state[0, r]``, offset ``state[1, r] + delta``; elements ``0 .. n-1`` of its draw."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(state_ptr + row)
    offset = tl.load(state_ptr + stride_state + row) + delta
    ok = cols < n
    if RAW:
        tl.store(out_ptr + row * stride_out + cols, philox_words(seed, offset, cols).to(tl.int64), mask=ok)
    else:
        tl.store(out_ptr + row * stride_out + cols, exponential_at(seed, offset, cols, FAST_LOG), mask=ok)


def exponential_rows(state: torch.Tensor, out: torch.Tensor, delta: int = 0, *, raw: bool = False) -> torch.Tensor:
    """Fill ``out`` (R, n) fp32 with each row's ``exponential_`` draw: row ``r`` as a CUDA generator with seed
    ``state[0, r]`` (int64 bits of the uint64 seed) and offset ``state[1, r] + delta`` would draw it.

    ``state`` is (2, >= R) int64 and may be a view of a larger buffer (a graph input).  ``raw=True`` (int64
    ``out``) stores the Philox words instead, for tests.  Nothing touches a generator: the caller advances it.
    """
    rows, n = out.shape
    if not 0 < n <= MAX_ELEMENTS:
        raise ValueError(f"exponential_rows draws 1 to {MAX_ELEMENTS} elements per row, got {n}")
    if state.dtype != torch.int64 or state.dim() != 2 or state.shape[0] != 2 or state.shape[1] < rows:
        raise ValueError(f"state must be (2, >= {rows}) int64 (seeds, offsets), got {tuple(state.shape)} "
                         f"{state.dtype}")
    if state.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("state and out need unit stride along their last dimension")
    block = min(1024, triton.next_power_of_2(n))
    _exponential_kernel[(rows, triton.cdiv(n, block))](
        state, out, n, state.stride(0), out.stride(0), delta, BLOCK=block, FAST_LOG=not interpreting(), RAW=raw)
    return out
