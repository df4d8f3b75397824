"""The nucleus draw of :func:`..backends.nucleus.nucleus_pick_rows` after its softmax, as one Triton launch.

The torch path stable-sorts all V probabilities of each row (about 9 CUDA kernels for V = 6564) only to look at
the first ``top_k``, then cuts at ``top_p`` with sequential fp32 running sums, divides by the exponential
variates and takes an argmax (about 8 more small kernels).  Here one program holds a whole row as unique int64
keys: a non-negative fp32's bit pattern orders like its value, so ``bits(p) << 32 | (2**31 - 1 - id)`` orders
exactly like the stable descending sort (larger probability first, smaller id first on ties).

The head is taken one candidate at a time, each a max-reduction over the whole row; once the running sum
reaches ``top_p`` every later candidate is cut, so the walk stops there.  That is ``top_k`` block-wide reductions
in a row for a flat row; the variates are held in registers and the scores taken after the walk, so nothing in
it waits on memory.  ``USE_FLOOR`` cuts the row first instead: split into groups of consecutive ids, the
``top_k`` largest group maxima are ``top_k`` distinct keys, so the ``top_k``-th largest of them is a floor no
head key is below.  The keys at or above it (a few dozen on a speech-token row) are packed into the program's
workspace, ranked against each other in one comparison, and the head is written back in order; a row the floor
does not cut to ``CANDIDATES`` keys (many exact ties) walks instead.  Both give the same head.  The cut is off
by default: it is faster alone but measured no faster inside a decode step (BENCHMARKS.md, session 28).

The running sum, the cut, the IEEE division (``div_rn``: Triton's ``/`` may be approximate) and the first-wins
argmax follow the order the torch path computes them in, so the tokens are the same bit for bit (the CPU tests
compare both ways of cutting with a numpy reference, the GPU tests with the torch path on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.common import can_run_on

#: the longest ``top_k`` head drawn from (the draw's variates ``q`` are drawn for all of it)
MAX_TOP_K = 64
#: the widest row one program holds in registers (the speech vocabulary is 6564)
MAX_VOCAB = 16384
#: at most this many keys at or above the floor are ranked directly; a row with more walks all of its keys
CANDIDATES = tl.constexpr(128)
#: ids per group for the floor is the row's power-of-two width over this (at most this many groups)
GROUPS = 128
#: int64 workspace per row: the packed candidates, then the ordered head
SCRATCH = tl.constexpr(CANDIDATES.value + MAX_TOP_K)
#: cut rows at the floor before ranking (read at launch).  Off by default: faster than the walk on its own, but
#: slower inside a decode step's rule kernel (BENCHMARKS.md, sessions 28 and 32, has the measurements)
USE_FLOOR = False


@triton.jit
def _keys(probs_ptr, row, stride_p, cols, V):
    """The unique int64 keys of ids ``cols`` (any shape) of row ``row``; -1 past ``V``."""
    valid = cols < V
    p = tl.load(probs_ptr + row * stride_p + cols, mask=valid, other=0.0)
    bits = tl.where(p == 0.0, 0, p.to(tl.int32, bitcast=True))  # -0.0 ranks as +0.0, like the sort
    keys = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)  # smaller ids rank first among ties
    return tl.where(valid, keys, -1)  # below every real key (those are > 0)


@triton.jit
def _row_keys(probs_ptr, row, V, stride_p, G: tl.constexpr, S: tl.constexpr):
    """Row ``row`` as (G, S) keys: group ``g`` holds ids ``g·S .. g·S + S - 1``."""
    return _keys(probs_ptr, row, stride_p, tl.arange(0, G)[:, None] * S + tl.arange(0, S)[None, :], V)


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
def _walk_head(head_ptr, q, limit, K, BLOCK_K: tl.constexpr):
    """The head's first argmax of ``p / q`` over the kept candidates, from the sorted head keys at
    ``head_ptr`` (K of them): the running sums one scalar at a time, in order, the rest on vectors."""
    kk = tl.arange(0, BLOCK_K)
    inside = kk < K
    head = tl.load(head_ptr + kk, mask=inside, other=0, cache_modifier=".cg")
    run = tl.zeros([], dtype=tl.float32)
    before = tl.zeros([BLOCK_K], dtype=tl.float32)  # fp32 sum of the candidates before each, added in order
    for j in tl.static_range(BLOCK_K):
        before = tl.where(kk == j, run, before)
        run = run + _key_p(tl.load(head_ptr + j, mask=j < K, other=0, cache_modifier=".cg"))
    return _first_best(head, q, inside & ((kk == 0) | (before < limit)), kk)


@triton.jit
def row_variates(q_ptr, row, K, stride_q, BLOCK_K: tl.constexpr):
    """Row ``row``'s ``K`` draw variates from a (B, K) buffer as (BLOCK_K,), 1.0 past K."""
    kk = tl.arange(0, BLOCK_K)
    return tl.load(q_ptr + row * stride_q + kk, mask=kk < K, other=1.0)


@triton.jit
def draw_row(probs_ptr, q, limit_ptr, scratch_ptr, row, V, K, stride_p, G: tl.constexpr, S: tl.constexpr,
             BLOCK_K: tl.constexpr, CUT: tl.constexpr):
    """Row ``row``'s token: ``argmax_j keep[j] ? head_p[j] / q[j] : -inf`` over the stable top-K head, ``q``
    the row's variates as (BLOCK_K,) (shared by this module's kernel and the RAS kernels of :mod:`.ras_rule`).
    ``scratch_ptr`` is the row's ``SCRATCH`` int64 of workspace."""
    limit = tl.load(limit_ptr)
    if CUT:
        keys = _row_keys(probs_ptr, row, V, stride_p, G, S)
        # the K-th largest group maximum bounds the head from below: the K largest groups hold K keys >= it
        most = tl.max(keys, axis=1)
        above = tl.sum((most[None, :] > most[:, None]).to(tl.int32), axis=1)  # (G,): group maxima above each
        floor = tl.min(tl.where(above < K, most, 0x7FFFFFFFFFFFFFFF), axis=0)
        floor = tl.where(K > G, 1, tl.maximum(floor, 1))  # fewer groups than K: every real key (all are > 0)
        pick = (keys >= floor).to(tl.int32)
        count = tl.sum(tl.sum(pick, axis=1), axis=0)
        if count <= CANDIDATES:
            # pack the candidates (row-major order), rank them against each other, write the head in order
            per_group = tl.sum(pick, axis=1)
            slot = (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(pick, axis=1) - 1
            tl.store(scratch_ptr + slot, keys, mask=pick != 0)
            tl.debug_barrier()
            c = tl.arange(0, CANDIDATES)
            cand = tl.load(scratch_ptr + c, mask=c < count, other=-1, cache_modifier=".cg")
            rank = tl.sum((cand[None, :] > cand[:, None]).to(tl.int32), axis=1)
            tl.store(scratch_ptr + CANDIDATES + rank, cand, mask=(c < count) & (rank < K))
            tl.debug_barrier()
            token = _walk_head(scratch_ptr + CANDIDATES, q, limit, K, BLOCK_K)
        else:
            token = _walk_all(probs_ptr, q, limit, row, V, K, stride_p, G * S, BLOCK_K)
    else:
        token = _walk_all(probs_ptr, q, limit, row, V, K, stride_p, G * S, BLOCK_K)
    return token


@triton.jit
def _nucleus_draw_kernel(probs_ptr, q_ptr, limit_ptr, scratch_ptr, out_ptr, V, K, stride_p, stride_q,
                         G: tl.constexpr, S: tl.constexpr, BLOCK_K: tl.constexpr, CUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    q = row_variates(q_ptr, row, K, stride_q, BLOCK_K)
    token = draw_row(probs_ptr, q, limit_ptr, scratch_ptr + row * SCRATCH, row, V, K, stride_p, G, S, BLOCK_K,
                     CUT)
    tl.store(out_ptr + row, token)


def draw_shape(vocab: int, k: int) -> dict[str, int]:
    """The draw's block sizes for rows of ``vocab`` and a head of ``k``: ``G`` groups of ``S`` ids (``G * S``
    is the row's power-of-two width) and ``BLOCK_K``."""
    block = triton.next_power_of_2(vocab)
    s = max(1, block // GROUPS)
    return {"G": block // s, "S": s, "BLOCK_K": triton.next_power_of_2(k), "CUT": USE_FLOOR}


def draw_scratch(rows: int, device: torch.device) -> torch.Tensor:
    """The draw's workspace for ``rows`` rows (every launch writes what it reads: no clearing needed)."""
    return torch.empty(rows, SCRATCH.value, dtype=torch.int64, device=device)


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
    _nucleus_draw_kernel[(rows,)](probs, q, limit, draw_scratch(rows, probs.device), out, vocab, q.shape[1],
                                  probs.stride(0), q.stride(0), **draw_shape(vocab, q.shape[1]),
                                  num_warps=row_warps(triton.next_power_of_2(vocab)))
    return out


def candidate_count(probs: torch.Tensor, k: int) -> torch.Tensor:
    """How many keys of each row of ``probs`` (B, V) the draw's floor keeps for a head of ``k``, (B,) int64 (the
    same rule in torch ops): at most ``CANDIDATES`` are ranked directly, more take the walk over the row."""
    rows, vocab = probs.shape
    shape = draw_shape(vocab, k)
    ids = torch.arange(shape["G"] * shape["S"], device=probs.device)
    p = torch.zeros(rows, ids.numel(), dtype=torch.float32, device=probs.device)
    p[:, :vocab] = probs
    bits = torch.where(p == 0.0, 0, p.view(torch.int32)).to(torch.int64)
    keys = torch.where(ids < vocab, (bits << 32) | (0x7FFFFFFF - ids), -1)
    most = keys.view(rows, shape["G"], shape["S"]).amax(dim=2)
    if k > shape["G"]:
        return (keys > 0).sum(dim=1)
    floor = most.sort(dim=1, descending=True).values[:, k - 1].clamp(min=1)
    return (keys >= floor[:, None]).sum(dim=1)
