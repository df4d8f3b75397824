"""The nucleus draw as graph-capturable tensor math: the eager RAS sampler's draw, without host syncs.

``torch.multinomial(p[:n], 1)`` is ``argmax(p[:n] / q)`` with ``q = empty_like(p[:n]).exponential_(gen)``.  On
CUDA, element ``i`` of an exponential draw comes from Philox counter ``i`` and the generator's offset advances by
the same amount for any length up to 256, so drawing ``q`` for all ``top_k`` candidates (eagerly, into a static
buffer, just before a replay) and masking those past the nucleus gives the same token *and* leaves the generator
in the same state.  The nucleus size uses sequential fp32 running sums like
:func:`..models.sampling._nucleus_size`: a CUDA ``cumsum`` along a non-innermost dimension is one thread walking
the column in order.  The GPU tests assert both claims (tokens equal eager's; cuts equal the host loop).

After the softmax, the draw itself (stable sort, cut, division, argmax: ~17 small kernels) runs as one launch
of :func:`..kernels.nucleus_topk.nucleus_draw_rows` wherever Triton runs the tensors (CUDA, or the interpreter
on CPU): it selects the ``top_k`` head instead of sorting all V ids and computes the same tokens bit for bit
(GPU tests compare both paths).  Elsewhere the torch ops below run.  With the repetition-aware rule
(:func:`ras_pick_into`, the decode graph's tail) the rule and the fallback draw are two more launches of
:mod:`..kernels.ras_rule` instead of about a dozen torch ops.
"""

from __future__ import annotations

from types import ModuleType

import torch

_NEG_INF = -float("inf")



def _draw_kernel(probs: torch.Tensor, k: int, kernel: bool = True) -> ModuleType | None:
    """The kernel module when it can draw from ``probs`` (B, V) with ``k`` variates per row here, else None
    (and None with ``kernel`` False: the callers' torch ops, which the tests use as the reference)."""
    if not kernel:
        return None
    try:
        from cosyvoice_fast.llm.kernels import nucleus_topk
    except ImportError:  # no triton: the torch path
        return None
    vocab = probs.shape[-1]
    fits = vocab <= nucleus_topk.MAX_VOCAB and k <= min(vocab, nucleus_topk.MAX_TOP_K)
    return nucleus_topk if fits and nucleus_topk.can_run_on(probs.device) else None


def nucleus_keep(head_p: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Which of the sorted top-k probabilities (k,) the nucleus keeps: candidate ``j`` is kept while the fp32
    running sum of the ``j`` before it is ``< limit``; the first is always kept.

    The running sums must be the sequential fp32 sums the eager sampler computes on the host.  CUDA's ``cumsum``
    along an outer dimension is exactly that (one thread per column, in order), hence the dummy second column;
    along the only dimension it would be a parallel scan with different rounding.  (On CPU, cumsum accumulates
    in fp64, so this is exact only on CUDA.)
    """
    run = torch.stack((head_p, head_p), dim=1).cumsum(dim=0)[:, 0]
    first = torch.ones(1, dtype=torch.bool, device=head_p.device)
    return torch.cat((first, run[:-1] < limit))


def nucleus_pick(logp: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, limit: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the step's mask, then draw from the nucleus given exponential variates ``q`` (top_k,).

    Returns ``(masked log-probs (V,), token (1,) int64)``, both on the GPU, no host sync.  ``bias`` holds 0 or
    -inf per id (eos / stop ids masked), which equals the eager in-place ``-inf`` assignment.
    """
    logp = logp + bias
    probs = logp.softmax(dim=0)
    k = q.shape[0]
    kernel = _draw_kernel(probs, k)
    if kernel is not None:
        return logp, kernel.nucleus_draw_rows(probs[None], q[None], limit)
    sorted_p, sorted_i = probs.sort(descending=True, stable=True)
    head_p, head_i = sorted_p[:k], sorted_i[:k]
    score = torch.where(nucleus_keep(head_p, limit), head_p / q, _NEG_INF)
    return logp, head_i.gather(0, score.argmax(dim=0, keepdim=True))


def nucleus_keep_rows(head_p: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """:func:`nucleus_keep` for every row of (B, k) sorted top-k probabilities at once -> (B, k) bool.

    The running sums are taken down the columns of a (k, B + 1) contiguous copy: on CUDA that is the same
    one-thread-per-column sequential fp32 walk as :func:`nucleus_keep` (the extra column keeps B == 1 from
    collapsing into an innermost-dimension scan).
    """
    b = head_p.shape[0]
    cols = torch.cat((head_p, head_p[:1]), dim=0).t().contiguous()  # (k, B + 1)
    run = cols.cumsum(dim=0)[:, :b].t()  # (B, k)
    first = torch.ones(b, 1, dtype=torch.bool, device=head_p.device)
    return torch.cat((first, run[:, :-1] < limit), dim=1)


def nucleus_pick_rows(logp: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, limit: torch.Tensor,
                      kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nucleus_pick` for every row: ``logp``/``bias`` (B, V), ``q`` (B, top_k) -> ((B, V) masked
    log-probs, (B,) int64 tokens).  Row ``b``'s result is :func:`nucleus_pick` of row ``b``'s inputs: softmax,
    the stable sort, the cut and the argmax all work along the row.  ``kernel`` False: the sort-based torch
    ops even where the one-launch kernel runs (the same tokens)."""
    logp = logp + bias
    probs = logp.softmax(dim=-1)
    k = q.shape[-1]
    draw = _draw_kernel(probs, k, kernel)
    if draw is not None:
        return logp, draw.nucleus_draw_rows(probs, q, limit)
    sorted_p, sorted_i = probs.sort(dim=-1, descending=True, stable=True)
    head_p, head_i = sorted_p[:, :k], sorted_i[:, :k]
    score = torch.where(nucleus_keep_rows(head_p, limit), head_p / q, _NEG_INF)
    return logp, head_i.gather(1, score.argmax(dim=1, keepdim=True))[:, 0]


def ras_pick_rows(logp: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, q_again: torch.Tensor,
                  window: torch.Tensor, limit: torch.Tensor, repeats: int, kernel: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager RAS sampler for every row, fallback included, as graph-capturable math.

    ``q`` (B, top_k) are the variates of the nucleus draw; ``q_again`` (B, V) those the fallback draw would
    use (the same generator one ``exponential_`` later).  ``window`` (B, W) int64 holds each row's last W
    history tokens (-1 where the history is shorter).  A row whose nucleus token occurs at least ``repeats``
    times in its window redraws from the full distribution with that token banned: ``multinomial(softmax,
    1)``, i.e. ``argmax(softmax / q_again)``, exactly the eager ``random_sample``.
    Returns ``(masked log-probs (B, V), tokens (B,), fallback (B,) bool)``: the host advances each row's
    generator by one draw, or two where ``fallback`` is set.  ``kernel``: as for :func:`nucleus_pick_rows`.
    """
    logp, token = nucleus_pick_rows(logp, bias, q, limit, kernel)
    fallback = (window == token[:, None]).sum(dim=1) >= repeats
    banned = logp.scatter(1, token[:, None], _NEG_INF)
    again = (banned.softmax(dim=-1) / q_again).argmax(dim=1)
    return logp, torch.where(fallback, again, token), fallback


def ras_pick_into(logp: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, q_again: torch.Tensor,
                  window: torch.Tensor, limit: torch.Tensor, repeats: int, logp_out: torch.Tensor,
                  drawn: torch.Tensor, gens: torch.Tensor | None = None, kernel: bool = True) -> None:
    """:func:`ras_pick_rows` written into a decode graph's buffers: the masked log-probs into ``logp_out``
    (B, V), the tokens into ``drawn[0]`` and the fallback flags (0/1) into ``drawn[1]`` ((2, B) int64).

    ``gens`` ((2, >= B) int64: each row's CUDA generator seed and offset) says where the variates come from:
    with it, ``q`` and ``q_again`` are those generators' next two ``exponential_`` draws (Philox recomputed on
    the device, :mod:`..kernels.philox`), without it the caller has filled them.

    Where the kernels run (:func:`_draw_kernel`), five launches: the masked add, torch's softmax, the draw
    with the rule (:func:`..kernels.ras_rule.ras_rule_rows`), torch's softmax of the banned copy and the
    fallback draw (:func:`..kernels.ras_rule.ras_redraw_rows`); with ``gens`` the two draw kernels compute
    their variates themselves (two Philox launches fewer), the fallback draw's only for the rows that fall
    back.  The same values as the torch ops bit for bit.  Elsewhere (or with ``kernel`` False, the tests'
    reference) the Philox kernel fills ``q`` and ``q_again`` from ``gens``, then :func:`ras_pick_rows` and
    three copies."""
    kernels = _draw_kernel(logp, q.shape[-1], kernel) is not None
    if gens is not None and not kernels:
        from cosyvoice_fast.llm.kernels.philox import DRAW_OFFSET, exponential_rows

        exponential_rows(gens, q)
        exponential_rows(gens, q_again, DRAW_OFFSET)
        gens = None
    if not kernels:
        masked, token, fallback = ras_pick_rows(logp, bias, q, q_again, window, limit, repeats, kernel)
        logp_out.copy_(masked)
        drawn[0].copy_(token)
        drawn[1].copy_(fallback)
        return
    from cosyvoice_fast.llm.kernels.ras_rule import ras_redraw_rows, ras_rule_rows

    torch.add(logp, bias, out=logp_out)
    banned = ras_rule_rows(logp_out.softmax(dim=-1), logp_out, q, limit, window, repeats, drawn, gens=gens)
    ras_redraw_rows(banned.softmax(dim=-1), q_again, drawn, gens=gens)
