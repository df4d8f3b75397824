"""The repetition-aware sampler's rule and fallback draw inside the decode graph, as two Triton launches.

:func:`..backends.nucleus.ras_pick_rows` is the reference: after the nucleus draw it counts the token in the
row's window, bans it in a copy of the log-probs, takes the softmax of that copy and draws from it with the
second set of exponential variates (``argmax(softmax / q_again)``), then picks per row.  As torch operations
that is about a dozen small launches per decode step (compare, sum, compare, clone, scatter, divide, argmax,
select, two copies), each a few microseconds of a step that takes ~0.6 ms at one row.  Here:

- :func:`ras_rule_rows` draws the nucleus token (the same code as :mod:`.nucleus_topk`), counts it in the
  window and writes the fallback flag and the banned copy of the log-probs: one launch;
- the softmax of the banned copy stays torch's own kernel, so its rounding (a reduction) is exactly the
  reference's;
- :func:`ras_redraw_rows` divides by the variates with IEEE rounding (``div_rn``), takes the first argmax and
  writes the step's token: one launch, which does nothing on a row that keeps its nucleus token.

Given each row's generator state (``gens``: seed and offset, as the decode graph holds them) both kernels
compute their variates with :func:`.philox.exponential_at`, the Philox kernel's own code, instead of reading
buffers that two launches of that kernel would have filled; the fallback draw's 6564 only for rows that redraw.

Every operation is elementwise, an exact integer count, or the same ordered scalar walk as the reference, so
the tokens and flags are those of :func:`..backends.nucleus.ras_pick_rows` bit for bit (CPU interpreter tests
and GPU tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.common import interpreting
from cosyvoice_fast.llm.kernels.nucleus_topk import check_draw, draw_row, row_variates, row_warps
from cosyvoice_fast.llm.kernels.philox import DRAW_OFFSET, exponential_at


@triton.jit
def _rule_kernel(probs_ptr, logp_ptr, q_ptr, gens_ptr, limit_ptr, win_ptr, drawn_ptr, banned_ptr, V, K, W,
                 repeats, stride_p, stride_l, stride_q, stride_g, stride_wb, stride_ww, stride_d, stride_b,
                 BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, GENS: tl.constexpr,
                 FAST_LOG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if GENS:  # the variates from the row's generator state (seed, offset), also written to q
        kk = tl.arange(0, BLOCK_K)
        q = exponential_at(tl.load(gens_ptr + row), tl.load(gens_ptr + stride_g + row), kk, FAST_LOG)
        q = tl.where(kk < K, q, 1.0)
        tl.store(q_ptr + row * stride_q + kk, q, mask=kk < K)
    else:
        q = row_variates(q_ptr, row, K, stride_q, BLOCK_K)
    token = draw_row(probs_ptr, q, limit_ptr, row, V, K, stride_p, BLOCK_V, BLOCK_K)
    w = tl.arange(0, BLOCK_W)
    hist = tl.load(win_ptr + row * stride_wb + w * stride_ww, mask=w < W, other=-1)
    fallback = (tl.sum((hist == token).to(tl.int32), axis=0) >= repeats).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    valid = cols < V
    lp = tl.load(logp_ptr + row * stride_l + cols, mask=valid, other=0.0)
    tl.store(banned_ptr + row * stride_b + cols, tl.where(cols == token, float("-inf"), lp), mask=valid)
    tl.store(drawn_ptr + row, token)
    tl.store(drawn_ptr + stride_d + row, fallback)


@triton.jit
def _redraw_kernel(p_ptr, q_ptr, gens_ptr, drawn_ptr, V, stride_p, stride_q, stride_g, stride_d, delta,
                   BLOCK_V: tl.constexpr, GENS: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(drawn_ptr + stride_d + row) != 0:  # a row that keeps its nucleus token has nothing to redraw
        cols = tl.arange(0, BLOCK_V)
        valid = cols < V
        p = tl.load(p_ptr + row * stride_p + cols, mask=valid, other=0.0)
        if GENS:  # the fallback draw's variates: the row's generator one exponential_ further
            offset = tl.load(gens_ptr + stride_g + row) + delta
            q = exponential_at(tl.load(gens_ptr + row), offset, cols, FAST_LOG)
        else:
            q = tl.load(q_ptr + row * stride_q + cols, mask=valid, other=1.0)
        score = tl.where(valid, tl.math.div_rn(p, q), float("-inf"))
        again = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)  # the first of equal maxima, like torch
        tl.store(drawn_ptr + row, again)


def _check_gens(gens: torch.Tensor | None, rows: int, device: torch.device) -> None:
    if gens is None:
        return
    if gens.dim() != 2 or gens.shape[0] != 2 or gens.shape[1] < rows or gens.dtype != torch.int64 \
            or gens.stride(1) != 1:
        raise ValueError(f"gens must be (2, >= {rows}) int64 with unit stride along rows (each row's generator "
                         f"seed and offset), got {tuple(gens.shape)} {gens.dtype} strides {gens.stride()}")
    if gens.device != device:
        raise ValueError(f"gens is on {gens.device}, the probabilities on {device}")


def _check_drawn(drawn: torch.Tensor, rows: int, device: torch.device) -> None:
    if drawn.dim() != 2 or drawn.shape != (2, rows) or drawn.dtype != torch.int64 or drawn.stride(1) != 1:
        raise ValueError(f"drawn must be a (2, {rows}) int64 tensor with unit stride along rows (tokens; fallback "
                         f"flags), got {tuple(drawn.shape)} {drawn.dtype} strides {drawn.stride()}")
    if drawn.device != device:
        raise ValueError(f"drawn is on {drawn.device}, the probabilities on {device}")


def ras_rule_rows(probs: torch.Tensor, logp: torch.Tensor, q: torch.Tensor, limit: torch.Tensor,
                  window: torch.Tensor, repeats: int, drawn: torch.Tensor,
                  gens: torch.Tensor | None = None) -> torch.Tensor:
    """The nucleus draw and the repetition rule for every row, in one launch.

    ``probs`` (B, V) float32 is the softmax of the masked log-probs ``logp`` (B, V) float32; ``q`` (B, top_k)
    the nucleus variates; ``window`` (B, W) int64 each row's last W history tokens (-1 where shorter); a row
    falls back when its nucleus token occurs at least ``repeats`` times there.  With ``gens`` ((2, >= B) int64:
    each row's CUDA generator seed and offset) the kernel computes the variates itself, as
    :func:`.philox.exponential_rows` would, and writes them to ``q`` instead of reading it: one launch less.
    Writes ``drawn[0]`` (the nucleus tokens) and ``drawn[1]`` (1 where the row falls back, else 0) and returns
    the banned copy of ``logp`` (the token's entry ``-inf``) whose softmax :func:`ras_redraw_rows` draws from.
    No host sync.
    """
    check_draw(probs, q, limit, None)
    rows, vocab = probs.shape
    if logp.shape != probs.shape or logp.dtype != torch.float32 or logp.stride(-1) != 1:
        raise ValueError(f"logp must be ({rows}, {vocab}) float32 with unit stride along V like probs, got "
                         f"{tuple(logp.shape)} {logp.dtype} strides {logp.stride()}")
    if window.dim() != 2 or window.shape[0] != rows or window.dtype != torch.int64:
        raise ValueError(f"window must be ({rows}, W) int64 (each row's last history tokens), got "
                         f"{tuple(window.shape)} {window.dtype}")
    _check_drawn(drawn, rows, probs.device)
    _check_gens(gens, rows, probs.device)
    banned = torch.empty_like(logp)
    if rows == 0:
        return banned
    block = triton.next_power_of_2(vocab)
    w = window.shape[1]
    _rule_kernel[(rows,)](probs, logp, q, q if gens is None else gens, limit, window, drawn, banned, vocab,
                          q.shape[1], w, repeats, probs.stride(0), logp.stride(0), q.stride(0),
                          0 if gens is None else gens.stride(0), window.stride(0), window.stride(1),
                          drawn.stride(0), banned.stride(0), BLOCK_V=block,
                          BLOCK_W=max(2, triton.next_power_of_2(max(w, 1))),
                          BLOCK_K=triton.next_power_of_2(q.shape[1]), num_warps=row_warps(block),
                          GENS=gens is not None, FAST_LOG=not interpreting())
    return banned


def ras_redraw_rows(banned_probs: torch.Tensor, q_again: torch.Tensor | None, drawn: torch.Tensor,
                    gens: torch.Tensor | None = None) -> None:
    """The fallback draw: where ``drawn[1]`` is set, ``drawn[0]`` becomes ``argmax(banned_probs / q_again)``
    (IEEE division, the first of equal maxima), the eager ``multinomial`` of the banned distribution.
    ``banned_probs`` and ``q_again`` are (B, V) float32.  With ``gens`` (as for :func:`ras_rule_rows`) the
    variates are each row's generator one ``exponential_`` past the nucleus draw's, computed in the kernel
    (``q_again`` is not used) and only for the rows that fall back.  One launch, no host sync."""
    rows, vocab = banned_probs.shape
    for name, t in (("banned_probs", banned_probs), ("q_again", q_again)):
        if t is None and name == "q_again" and gens is not None:
            continue
        if t is None or t.shape != (rows, vocab) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be ({rows}, {vocab}) float32 with unit stride along V, got "
                             f"{None if t is None else (tuple(t.shape), t.dtype, t.stride())}")
    _check_drawn(drawn, rows, banned_probs.device)
    _check_gens(gens, rows, banned_probs.device)
    if rows == 0:
        return
    block = triton.next_power_of_2(vocab)
    q = banned_probs if q_again is None else q_again
    _redraw_kernel[(rows,)](banned_probs, q, q if gens is None else gens, drawn, vocab, banned_probs.stride(0),
                            q.stride(0), 0 if gens is None else gens.stride(0), drawn.stride(0), DRAW_OFFSET,
                            BLOCK_V=block,
                            GENS=gens is not None, FAST_LOG=not interpreting(), num_warps=row_warps(block))
