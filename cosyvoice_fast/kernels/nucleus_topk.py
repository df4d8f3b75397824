"""The nucleus draw of :func:`..backends.nucleus.nucleus_pick_rows` after its softmax, as one Triton launch.

The torch path stable-sorts all V probabilities of each row (about 9 CUDA kernels for V = 6564) only to look at
the first ``top_k``, then cuts at ``top_p`` with sequential fp32 running sums, divides by the exponential
variates and takes an argmax (about 8 more small kernels).  Here one program holds a whole row and selects the
``top_k`` head one candidate at a time with a max-reduction over unique int64 keys: a non-negative fp32's bit
pattern orders like its value, so ``bits(p) << 32 | (2**31 - 1 - id)`` orders exactly like the stable
descending sort (larger probability first, smaller id first on ties) and no two ids share a key.  The running
sum, the cut, the IEEE division (``div_rn``: Triton's ``/`` may be approximate) and the first-wins argmax are
scalars updated in the order the torch path computes them, so the tokens are the same bit for bit (the GPU
tests compare both on CUDA).  Once the running sum reaches ``top_p`` every later candidate is cut, so the loop
stops there: a peaked row costs a few reductions, not ``top_k``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .estimator_common import can_run_on

#: the longest ``top_k`` head drawn from (the draw's variates ``q`` are drawn for all of it)
MAX_TOP_K = 64
#: the widest row one program holds in registers (the speech vocabulary is 6564)
MAX_VOCAB = 16384


@triton.jit
def draw_row(probs_ptr, q_ptr, limit_ptr, row, V, K, stride_p, stride_q, BLOCK_V: tl.constexpr):
    """Row ``row``'s token: ``argmax_j keep[j] ? head_p[j] / q[row, j] : -inf`` over the stable top-K head
    (shared by this module's kernel and the RAS kernels of :mod:`.ras_rule`)."""
    cols = tl.arange(0, BLOCK_V)
    valid = cols < V
    p = tl.load(probs_ptr + row * stride_p + cols, mask=valid, other=0.0)
    bits = tl.where(p == 0.0, 0, p.to(tl.int32, bitcast=True))  # -0.0 ranks as +0.0, like the sort
    keys = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)  # smaller ids rank first among ties
    keys = tl.where(valid, keys, -1)  # below every real key (those are > 0)
    limit = tl.load(limit_ptr)
    run = tl.zeros([], dtype=tl.float32)  # fp32 sum of the candidates taken so far, added in order
    best = tl.full([], float("-inf"), dtype=tl.float32)
    token = tl.zeros([], dtype=tl.int64)
    j = tl.zeros([], dtype=tl.int32)
    go = j < K  # candidate 0 is always kept
    while go:
        top = tl.max(keys, axis=0)
        keys = tl.where(keys == top, -1, keys)
        head_p = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        head_i = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        score = tl.math.div_rn(head_p, tl.load(q_ptr + row * stride_q + j))
        better = score > best  # strict: the first of equal scores wins, like argmax
        token = tl.where(better, head_i, token)
        best = tl.where(better, score, best)
        run = run + head_p
        j = j + 1
        go = (j < K) & (run < limit)  # candidate j is kept while the sum of those before it is < limit
    return token


@triton.jit
def _nucleus_draw_kernel(probs_ptr, q_ptr, limit_ptr, out_ptr, V, K, stride_p, stride_q,
                         BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, draw_row(probs_ptr, q_ptr, limit_ptr, row, V, K, stride_p, stride_q, BLOCK_V))


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
    block = triton.next_power_of_2(vocab)
    _nucleus_draw_kernel[(rows,)](probs, q, limit, out, vocab, q.shape[1], probs.stride(0), q.stride(0),
                                  BLOCK_V=block, num_warps=row_warps(block))
    return out
