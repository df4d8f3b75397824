"""The nucleus draw of :func:`..backends.nucleus.nucleus_pick_rows` after its softmax, as one Triton launch.

The torch path stable-sorts all V probabilities of each row (about 9 CUDA kernels for V = 6564) only to look at
the first ``top_k``, then cuts at ``top_p`` with sequential fp32 running sums, divides by the exponential
variates and takes an argmax (about 8 more small kernels).  Here one program holds a whole row as unique int64
keys: a non-negative fp32's bit pattern orders like its value, so ``bits(p) << 32 | (2**31 - 1 - id)`` orders
exactly like the stable descending sort (larger probability first, smaller id first on ties).

The head is taken one candidate at a time, each a max-reduction over the whole row; once the running sum
reaches ``top_p`` every later candidate is cut, so the walk stops there.  That is ``top_k`` block-wide reductions
in a row for a flat row; the variates are held in registers and the scores taken after the walk, so nothing in
it waits on memory.  (Cutting the row at a floor first and ranking the few dozen keys above it was faster alone
but measured no faster inside a decode step's rule kernel, so the walk is the only way.)

The running sum, the cut, the IEEE division (``div_rn``: Triton's ``/`` may be approximate) and the first-wins
argmax follow the order the torch path computes them in, so the tokens are the same bit for bit (the CPU tests
compare it with a numpy reference, the GPU tests with the torch path on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.common import can_run_on

#: the longest ``top_k`` head drawn from (the draw's variates ``q`` are drawn for all of it)
MAX_TOP_K = 64
#: the widest row one program holds in registers (the speech vocabulary is 6564; CosyVoice3: 6761)
MAX_VOCAB = 16384

@triton.jit
def _keys(probs_ptr, row, stride_p, cols, V):
    """The unique int64 keys of ids ``cols`` (any shape) of row ``row``; -1 past ``V``."""
    valid = cols < V
    p = tl.load(probs_ptr + row * stride_p + cols, mask=valid, other=0.0)
    bits = tl.where(p == 0.0, 0, p.to(tl.int32, bitcast=True))  # -0.0 ranks as +0.0, like the sort
    keys = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)  # smaller ids rank first among ties
    return tl.where(valid, keys, -1)  # below every real key (those are > 0)


@triton.jit
def _key_p(key):
    """A key's probability (its high word's fp32 bits)."""
    return (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _key_id(key):
    """A key's token id (from its low word)."""
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _first_best(head, q, kept, kk):
    """The token of the first ``argmax`` of ``p / q`` over the ``kept`` head keys (IEEE division)."""
    score = tl.where(kept, tl.math.div_rn(_key_p(head), q), float("-inf"))
    first = tl.argmax(score, axis=0, tie_break_left=True)  # the first of equal scores wins, like argmax
    return tl.sum(tl.where(kk == first, _key_id(head), 0), axis=0)


@triton.jit
def _walk_all(probs_ptr, q, limit, row, V, K, stride_p, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The head one candidate at a time, each a max-reduction over the whole row reloaded as one vector (any
    row, but ``K`` block-wide reductions in a row).  The loop only takes the candidates and their running sum;
    the variates ``q`` (BLOCK_K,) are in registers and the scores are one vector step after it, so no
    candidate waits on a memory round trip."""
    keys = _keys(probs_ptr, row, stride_p, tl.arange(0, BLOCK_V), V)
    kk = tl.arange(0, BLOCK_K)
    head = tl.full([BLOCK_K], -1, dtype=tl.int64)  # the candidates taken, in order
    run = tl.zeros([], dtype=tl.float32)  # fp32 sum of the candidates taken so far, added in order
    j = tl.zeros([], dtype=tl.int32)
    go = j < K  # candidate 0 is always kept
    while go:
        top = tl.max(keys, axis=0)
        keys = tl.where(keys == top, -1, keys)
        head = tl.where(kk == j, top, head)
        run = run + _key_p(top)
        j = j + 1
        go = (j < K) & (run < limit)  # candidate j is kept while the sum of those before it is < limit
    return _first_best(head, q, kk < j, kk)


@triton.jit
def row_variates(q_ptr, row, K, stride_q, BLOCK_K: tl.constexpr):
    """Row ``row``'s ``K`` draw variates from a (B, K) buffer as (BLOCK_K,), 1.0 past K."""
    kk = tl.arange(0, BLOCK_K)
    return tl.load(q_ptr + row * stride_q + kk, mask=kk < K, other=1.0)


@triton.jit
def draw_row(probs_ptr, q, limit_ptr, row, V, K, stride_p, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row ``row``'s token: ``argmax_j keep[j] ? head_p[j] / q[j] : -inf`` over the stable top-K head, ``q``
    the row's variates as (BLOCK_K,) (shared by this module's kernel and the RAS kernels of :mod:`.ras_rule`)."""
    return _walk_all(probs_ptr, q, tl.load(limit_ptr), row, V, K, stride_p, BLOCK_V, BLOCK_K)


@triton.jit
def _nucleus_draw_kernel(probs_ptr, q_ptr, limit_ptr, out_ptr, V, K, stride_p, stride_q,
                         BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    q = row_variates(q_ptr, row, K, stride_q, BLOCK_K)
    tl.store(out_ptr + row, draw_row(probs_ptr, q, limit_ptr, row, V, K, stride_p, BLOCK_V, BLOCK_K))


def draw_shape(vocab: int, k: int) -> dict[str, int]:
    """The draw's block sizes for rows of ``vocab`` and a head of ``k``: the row's power-of-two width
    ``BLOCK_V`` and ``BLOCK_K``."""
    return {"BLOCK_V": triton.next_power_of_2(vocab), "BLOCK_K": triton.next_power_of_2(k)}


def row_warps(block: int) -> int:
    """Warps for one program holding a whole row of ``block`` (a power of two) values: one per 1024, 1 to 16."""
    return max(1, min(16, block // 1024))


def check_draw(probs: torch.Tensor, q: torch.Tensor, limit: torch.Tensor, out: torch.Tensor | None) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError(f"probs must be (B, V) float32 with unit stride along V, got {tuple(probs.shape)} "
                         f"{probs.dtype} strides {probs.stride()}")
    rows, vocab = probs.shape
    if not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"probs rows must hold 1 to {MAX_VOCAB} probabilities, got V = {vocab}")
    if q.dim() != 2 or q.shape[0] != rows or q.dtype != torch.float32 or q.stride(-1) != 1:
        raise ValueError(f"q must be ({rows}, top_k) float32 with unit stride along top_k (one row of variates per "
                         f"probs row), got {tuple(q.shape)} {q.dtype} strides {q.stride()}")
    k = q.shape[1]
    if not 0 < k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"top_k (q's second dimension) must be 1 to min(V, {MAX_TOP_K}) = "
                         f"{min(vocab, MAX_TOP_K)}, got {k}")
    if limit.dim() != 0 or limit.dtype != torch.float32:
        raise ValueError(f"limit (top_p) must be a 0-dim float32 tensor, got {tuple(limit.shape)} {limit.dtype}")
    if out is not None and (out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({rows},) int64 tensor, got {tuple(out.shape)} {out.dtype}")
    tensors = (probs, q, limit) if out is None else (probs, q, limit, out)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"probs, q, limit and out must share one device, got {[str(t.device) for t in tensors]}")
    if not can_run_on(probs.device):
        raise RuntimeError("the nucleus kernel needs CUDA tensors (on CPU, set TRITON_INTERPRET=1 to run it "
                           "through Triton's interpreter, as the tests do)")


def nucleus_draw_rows(probs: torch.Tensor, q: torch.Tensor, limit: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's nucleus token from its probabilities ``probs`` (B, V) float32 (a softmax: >= 0, masked ids
    0.0), exponential variates ``q`` (B, top_k) float32 (> 0) and ``limit`` (top_p, 0-dim float32) -> (B,) int64.

    Row ``b``'s token is the second result of :func:`..backends.nucleus.nucleus_pick_rows` for the log-probs
    whose softmax is ``probs[b]``: the stable descending top-``k`` head, candidate ``j > 0`` kept while the
    sequential fp32 sum of the ``j`` before it is ``< limit``, then the first ``argmax`` of ``head_p / q``.
    No host sync: capturable in a CUDA graph (``out``, when given, is written in place).
    """
    check_draw(probs, q, limit, out)
    rows, vocab = probs.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    _nucleus_draw_kernel[(rows,)](probs, q, limit, out, vocab, q.shape[1], probs.stride(0), q.stride(0),
                                  **draw_shape(vocab, q.shape[1]),
                                  num_warps=row_warps(triton.next_power_of_2(vocab)))
    return out
