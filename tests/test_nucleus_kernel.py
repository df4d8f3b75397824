"""The one-launch nucleus draw (:mod:`cosyvoice_fast.llm.kernels.nucleus_topk`) against the sort-based torch path.

On CPU the kernel runs through Triton's interpreter and is compared token for token with a plain numpy
reference of the torch path's rule: stable descending order, the first ``top_k``, sequential fp32 running sums
for the cut, fp32 division by the variates, the first argmax.  (The torch path itself is not exact on CPU: its
``cumsum`` accumulates in fp64 there.)  The GPU tests compare the kernel with
:func:`~cosyvoice_fast.llm.nucleus.nucleus_pick_rows` itself on thousands of rows, and replay it in a graph.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cosyvoice_fast.llm import nucleus  # noqa: E402
from cosyvoice_fast.llm.nucleus import nucleus_pick_rows  # noqa: E402
from cosyvoice_fast.llm.kernels.nucleus_topk import MAX_TOP_K, MAX_VOCAB, nucleus_draw_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(probs: torch.Tensor, q: torch.Tensor, limit: float) -> list[int]:
    """The torch path's tokens in plain numpy: each row's stable descending top-k, candidate ``j > 0`` kept while
    the fp32 sum of those before it (added one at a time) is ``< limit``, then the first argmax of ``p / q``."""
    tokens = []
    lim = np.float32(limit)
    for p, qs in zip(probs.cpu().numpy(), q.cpu().numpy()):
        order = np.argsort(-p, kind="stable")[:qs.shape[0]]  # p >= 0: -p sorts ascending, ties by id
        run, best, token = np.float32(0.0), np.float32(-np.inf), -1
        for j, i in enumerate(order):
            if j > 0 and not run < lim:
                break
            score = np.float32(p[i] / qs[j])  # fp32 / fp32: IEEE round to nearest
            if score > best:
                best, token = score, int(i)
            run = np.float32(run + p[i])
        tokens.append(token)
    return tokens


def _draw(probs: torch.Tensor, q: torch.Tensor, limit: float) -> list[int]:
    out = nucleus_draw_rows(probs.to(DEV), q.to(DEV), torch.tensor(limit, device=DEV))
    assert out.dtype == torch.int64 and out.shape == (probs.shape[0],)
    return out.tolist()


def _random(rows: int, vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax rows from flat to peaked (so the nucleus holds from one to all ``k`` candidates) and variates."""
    g = torch.Generator().manual_seed(seed)
    temp = torch.logspace(-0.5, 1.0, rows)[:, None]
    probs = (torch.randn(rows, vocab, generator=g) * temp).softmax(-1)
    return probs, torch.empty(rows, k).exponential_(generator=g)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("vocab,k", [(6564, 25), (6564, 1), (37, 25), (37, 1), (37, 37)])
def test_random_rows_match_reference(rows, vocab, k):
    """Random rows of odd widths (not powers of two), top_k 25, 1 and the whole row: tokens equal the
    reference's, at top_p 0.8 and at a per-case random top_p."""
    probs, q = _random(rows, vocab, k, seed=rows * 1000 + vocab + k)
    for limit in (0.8, float(np.random.default_rng(vocab + k + rows).uniform(0.05, 1.0))):
        assert _draw(probs, q, limit) == reference(probs, q, limit)


def test_ties_rank_smaller_ids_first():
    """Probabilities quantised to a few exact values (many ties, like the stable sort resolves by id): equal
    rows and three-level rows, with variates random or all equal (then the first kept candidate wins)."""
    vocab, k = 6564, 25
    g = torch.Generator().manual_seed(7)
    levels = torch.tensor([0.0, 1e-4, 2e-4, 5e-4])
    draws = [torch.randint(lo, hi, (vocab,), generator=g) for lo, hi in ((1, 4), (0, 4), (0, 2))]
    probs = torch.stack([torch.full((vocab,), 1.0 / vocab)] + [levels[d] for d in draws])
    q_random = torch.empty(4, k).exponential_(generator=g)
    q_equal = torch.ones(4, k)
    for q in (q_random, q_equal):
        for limit in (0.8, 1e-3, 1.0):
            assert _draw(probs, q, limit) == reference(probs, q, limit)
    # all equal and one variate: every score ties, so the first candidate (id 0) wins
    assert _draw(probs[:1], q_equal[:1], 0.8) == [0]
    # smallest id of the top level comes first; with equal variates it wins
    assert _draw(probs[1:2], q_equal[:1], 0.8) == [int((probs[1] == 5e-4).nonzero()[0])]


def test_flat_peaked_and_clustered_rows_in_one_launch():
    """One launch over a random row, a row where every id ties and a row whose head is 25 neighbouring ids
    above a noise floor gives the reference's tokens (each program walks its own row)."""
    vocab, k = 6564, 25
    probs, q = _random(3, vocab, k, seed=31)
    probs[1] = torch.full((vocab,), 1.0 / vocab)  # every id ties
    probs[2] = torch.rand(vocab, generator=torch.Generator().manual_seed(32)) * 1e-4
    probs[2, 100:125] = torch.linspace(0.02, 0.01, 25)  # the head: ids 100..124
    probs[2] /= probs[2].sum()
    for limit in (0.8, 0.3, 1.0):
        assert _draw(probs, q, limit) == reference(probs, q, limit)
    assert reference(probs[2:], q[2:], 1.0)[0] in range(100, 125)


def test_zeros_masked_ids_and_limit_one():
    """Masked ids (exact 0.0) inside the head when few ids are left, a row of only zeros (every candidate kept,
    all scores 0: id 0 wins), limit 1.0 and above it (the whole head is kept)."""
    vocab, k = 37, 25
    probs, q = _random(4, vocab, k, seed=11)
    probs[:, 5:] = 0.0  # 5 live ids: the head holds 20 zeros
    probs[1, :] = 0.0
    probs[2, 30:] = 0.5  # live ids past the zeros too
    probs[2, :5] = 0.0
    probs[3, ::2] = 0.0
    for limit in (0.8, 1.0, 1.5):
        assert _draw(probs, q, limit) == reference(probs, q, limit)
    assert _draw(probs[1:2], q[1:2], 1.0) == [0]


def test_first_candidate_alone_past_limit():
    """A row whose top probability alone reaches top_p keeps only it, however small its score: the token is
    the top id even where the second candidate's score is a million times larger."""
    vocab, k = 6564, 25
    probs = torch.full((2, vocab), 0.1 / (vocab - 1))
    probs[0, 4321] = 0.9
    probs[1, 17] = 0.8  # exactly the limit: the sum before candidate 1 is not < 0.8
    q = torch.ones(2, k)
    q[:, 0] = 1e6
    assert _draw(probs, q, 0.8) == [4321, 17] == reference(probs, q, 0.8)
    # just under the limit, candidate 1 (the smallest id of the rest) is kept and wins
    assert _draw(probs[1:], q[1:], 0.80001) == [0] == reference(probs[1:], q[1:], 0.80001)


def test_equal_scores_first_candidate_wins():
    """Variates crafted so that two kept candidates score exactly the same: the earlier one in the order wins,
    whichever id is smaller."""
    probs = torch.zeros(2, 37)
    probs[:, [30, 3, 20, 9]] = torch.tensor([0.5, 0.25, 0.125, 0.125])  # order: 30, 3, then 9 before 20 (tie)
    q = torch.tensor([[4.0, 2.0, 1.0, 8.0],  # candidates 30 and 3: 0.125 each, candidate 9: 0.125 too
                      [8.0, 1.0, 8.0, 0.5]])  # candidates 3 and 20: 0.25 each
    assert _draw(probs, q, 1.5) == [30, 3] == reference(probs, q, 1.5)
    # row 1 scores 1/16, 1/16, 1/4, 1/2: the cut decides which candidate wins, and the tie of the first two
    q[1] = torch.tensor([8.0, 4.0, 0.5, 0.25])
    assert _draw(probs, q, 1.5) == [30, 20] == reference(probs, q, 1.5)
    assert _draw(probs, q, 0.8) == [30, 9] == reference(probs, q, 0.8)  # 0.875 before candidate 20
    assert _draw(probs, q, 0.7) == [30, 30] == reference(probs, q, 0.7)  # 0.75 before candidate 9


def test_out_is_written_in_place():
    """``out`` is filled and returned (a graph's static output buffer)."""
    probs, q = _random(3, 37, 5, seed=3)
    out = torch.full((3,), -7, dtype=torch.int64, device=DEV)
    got = nucleus_draw_rows(probs.to(DEV), q.to(DEV), torch.tensor(0.8, device=DEV), out=out)
    assert got is out and out.tolist() == reference(probs, q, 0.8)


def test_bad_inputs_say_what_is_expected():
    """Wrong dtypes, shapes, top_k past V or the cap, and a non-0-dim limit fail with messages naming the
    expected form."""
    probs, q = _random(2, 37, 5, seed=5)
    limit = torch.tensor(0.8)
    cases = [
        ((probs.double(), q, limit), "probs must be \\(B, V\\) float32"),
        ((probs[0], q, limit), "probs must be \\(B, V\\) float32"),
        ((probs.t(), q, limit), "unit stride along V"),
        ((probs, q.half(), limit), "q must be \\(2, top_k\\) float32"),
        ((probs, q[:1], limit), "q must be \\(2, top_k\\) float32"),
        ((probs, q[:, :, None], limit), "q must be \\(2, top_k\\) float32"),
        ((probs, torch.ones(2, 38), limit), "top_k .* must be 1 to min\\(V, 64\\) = 37, got 38"),
        ((torch.rand(2, 100), torch.ones(2, MAX_TOP_K + 1), limit), "= 64, got 65"),
        ((probs, q, torch.tensor([0.8])), "limit \\(top_p\\) must be a 0-dim float32 tensor"),
        ((probs, q, torch.tensor(0.8, dtype=torch.float64)), "limit \\(top_p\\) must be a 0-dim float32"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            nucleus_draw_rows(*args)
    with pytest.raises(ValueError, match="out must be a contiguous \\(2,\\) int64 tensor"):
        nucleus_draw_rows(probs, q, limit, out=torch.empty(2, dtype=torch.int32))


def test_nucleus_pick_rows_draws_through_the_kernel_where_it_runs():
    """``nucleus_pick_rows`` (the decode graphs' draw) takes the kernel here (CUDA, or the interpreter) and gives
    the reference's tokens; rows wider than the kernel's cap, a head longer than its cap, or ``kernel=False``
    take the torch ops instead."""
    probs, q = _random(4, 6564, 25, seed=21)
    logp = probs.log().to(DEV)
    limit = torch.tensor(0.8, device=DEV)
    assert nucleus._draw_kernel(probs.to(DEV), 25) is not None
    _, token = nucleus_pick_rows(logp, torch.zeros_like(logp), q.to(DEV), limit)
    want = reference(logp.softmax(-1), q, 0.8)
    assert token.tolist() == want
    assert nucleus._draw_kernel(torch.zeros(1, MAX_VOCAB + 1), 25) is None
    assert nucleus._draw_kernel(torch.zeros(1, 6564), MAX_TOP_K + 1) is None
    assert nucleus._draw_kernel(probs.to(DEV), 25, kernel=False) is None


# ------------------------------------------------------------------------------------------ GPU

_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _gpu_rows(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs on CUDA, a quarter of them tie-heavy (logits of three integer levels), and bias rows with
    some ids masked (-inf) on half of them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    temp = torch.logspace(-0.5, 1.2, rows, device="cuda")[:, None]
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * temp
    tied = torch.randint(0, 3, (rows // 4, vocab), device="cuda", generator=g).float() * 2.0
    logits[: rows // 4] = tied
    bias = torch.zeros(rows, vocab, device="cuda")
    masked = torch.rand(rows, vocab, device="cuda", generator=g) < 0.02
    masked[::2] = False
    bias[masked] = -float("inf")
    return logits.log_softmax(-1), bias


@_gpu
@pytest.mark.parametrize("vocab,k", [(6564, 25), (6564, 1), (6564, 64), (37, 37), (1000, 25)])
def test_gpu_tokens_equal_torch_path(vocab, k):
    """On CUDA the kernel's tokens equal ``nucleus_pick_rows``'s sort-based torch path bit for bit, for 2048 rows
    of each shape, at several top_p, with and without masked ids, tie-heavy rows included."""
    rows = 2048
    for seed, limit in enumerate((0.8, 0.5, 0.95, 1.0)):
        logp, bias = _gpu_rows(rows, vocab, seed)
        q = torch.empty(rows, k, device="cuda").exponential_()
        lim = torch.tensor(limit, device="cuda")
        for b in (torch.zeros_like(bias), bias):
            _, want = nucleus_pick_rows(logp, b, q, lim, kernel=False)  # the reference: the torch ops
            got = nucleus_draw_rows((logp + b).softmax(-1), q, lim)
            assert torch.equal(got, want), (limit, (got != want).sum().item())


@_gpu
def test_gpu_graph_replay():
    """The call captures in a CUDA graph (no host sync) and a replay on new inputs gives the new tokens."""
    rows, vocab, k = 8, 6564, 25
    logp, bias = _gpu_rows(rows, vocab, 99)
    probs, q = (logp + bias).softmax(-1), torch.empty(rows, k, device="cuda").exponential_()
    lim, out = torch.tensor(0.8, device="cuda"), torch.empty(rows, dtype=torch.int64, device="cuda")
    nucleus_draw_rows(probs, q, lim, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nucleus_draw_rows(probs, q, lim, out=out)
    logp2, _ = _gpu_rows(rows, vocab, 100)
    probs.copy_(logp2.softmax(-1))
    q.exponential_()
    graph.replay()
    assert torch.equal(out, nucleus_pick_rows(logp2, torch.zeros_like(logp2), q, lim, kernel=False)[1])
