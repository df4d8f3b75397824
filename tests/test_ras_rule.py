"""The decode graph's sampling tail as kernels (:mod:`cosyvoice_fast.llm.kernels.ras_rule`) and its input merge and
advance (:mod:`cosyvoice_fast.llm.kernels.step_feed`), each against the torch operations it replaces.

On CPU the kernels run through Triton's interpreter; the GPU tests repeat the comparison at the speech
vocabulary's width on thousands of rows, where torch's own CUDA softmax and division are the reference.
The backend-level equality (tokens and generator offsets equal to the eager sampler's, through joins and
cancels) is in ``tests/test_device_ras.py``, which runs these kernels too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cosyvoice_fast.llm import decode_feed  # noqa: E402
from cosyvoice_fast.llm.decode_feed import StepFeed  # noqa: E402
from cosyvoice_fast.llm.nucleus import nucleus_pick_rows, ras_pick_into, ras_pick_rows  # noqa: E402
from cosyvoice_fast.llm.kernels import ras_rule, step_feed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEG = -float("inf")


def _case(rows: int, vocab: int, k: int, w: int, seed: int) -> tuple:
    """Log-probs from flat to peaked with two masked ids, both variate sets, and windows in which about half
    the rows hold their nucleus token once or twice (so both outcomes of the rule at repeats 1 and 2)."""
    g = torch.Generator().manual_seed(seed)
    temp = torch.logspace(-0.5, 1.0, rows)[:, None]
    logp = (torch.randn(rows, vocab, generator=g) * temp).log_softmax(-1)
    bias = torch.zeros(rows, vocab)
    bias[:, -2:] = NEG
    q = torch.empty(rows, k).exponential_(generator=g)
    q_again = torch.empty(rows, vocab).exponential_(generator=g)
    _, nuc = nucleus_pick_rows(logp, bias, q, torch.tensor(0.8))
    window = torch.randint(0, vocab, (rows, w), generator=g)
    if w:
        window[:, 0] = -1  # a history shorter than the window
        for r in range(0, rows, 2):
            window[r, -1] = nuc[r]
            if r % 4 == 0 and w > 2:
                window[r, 1] = nuc[r]
    return logp, bias, q, q_again, window


def _both(logp, bias, q, q_again, window, repeats, limit=0.8, kernel=True):  # noqa: ANN001, ANN202
    """(reference, fused): :func:`ras_pick_rows` and :func:`ras_pick_into` on ``DEV`` (the kernels, unless
    ``kernel`` is False)."""
    args = [t.to(DEV) for t in (logp, bias, q, q_again, window)]
    lim = torch.tensor(limit, device=DEV)
    masked, token, fallback = ras_pick_rows(*args[:4], args[4], lim, repeats, kernel)
    rows, vocab = logp.shape
    logp_out = torch.full((rows, vocab), 7.0, device=DEV)
    drawn = torch.full((2, rows + 3), -5, dtype=torch.int64, device=DEV)  # a graph's buffer: wider than the step
    ras_pick_into(*args[:4], args[4], lim, repeats, logp_out, drawn[:, :rows], kernel=kernel)
    assert torch.equal(drawn[:, rows:], torch.full((2, 3), -5, device=DEV)), "wrote past the step's rows"
    return (masked, token, fallback), (logp_out, drawn[0, :rows], drawn[1, :rows])


@pytest.mark.parametrize("vocab,k,w", [(37, 5, 4), (37, 37, 10), (6564, 25, 10), (300, 1, 1), (300, 25, 0)])
@pytest.mark.parametrize("repeats", [1, 2])
def test_fused_tail_equals_the_torch_rule(vocab, k, w, repeats):
    """Tokens, fallback flags and masked log-probs of the kernels equal :func:`ras_pick_rows` exactly, with rows
    that keep their nucleus token and rows that redraw (widths that are not powers of two, top_k of 1 and of
    the whole row, windows of 0, 1 and 10)."""
    logp, bias, q, q_again, window = _case(8, vocab, k, w, seed=vocab + k + w + repeats)
    (masked, token, fallback), (logp_out, tok, fb) = _both(logp, bias, q, q_again, window, repeats)
    assert torch.equal(logp_out, masked)
    assert tok.tolist() == token.tolist()
    assert fb.tolist() == fallback.long().tolist()
    if w > 2 or (w >= 1 and repeats == 1):  # the case plants one or two repeats (see _case)
        assert 0 < int(fb.sum()) < 8, "the case must hold rows of both kinds"


@pytest.mark.parametrize("vocab,k,w", [(37, 5, 4), (6564, 25, 10)])
@pytest.mark.parametrize("kernel", [True, False])
def test_variates_from_generator_states_equal_the_philox_draws(vocab, k, w, kernel):
    """Given each row's generator state instead of variates, the tail draws as it does with the variates the
    Philox kernel computes from those states (the nucleus draw's, and the fallback's one draw later): the same
    tokens, flags and masked log-probs, and ``q`` holds the nucleus variates.  On the kernels the rule kernels
    compute the variates; on the torch ops (``kernel=False``) two Philox launches fill ``q`` and ``q_again``
    first."""
    from cosyvoice_fast.llm.kernels.philox import DRAW_OFFSET, exponential_rows

    rows = 8
    logp, bias, _, _, window = _case(rows, vocab, k, w, seed=vocab + w)
    g = torch.Generator().manual_seed(vocab)
    gens = torch.stack([torch.randint(-2**62, 2**62, (rows + 2,), generator=g),
                        torch.randint(0, 2**20, (rows + 2,), generator=g) * 4]).to(DEV)  # a wider graph buffer
    q = exponential_rows(gens, torch.empty(rows, k, device=DEV))
    q_again = exponential_rows(gens, torch.empty(rows, vocab, device=DEV), DRAW_OFFSET)
    _, (logp_ref, tok_ref, fb_ref) = _both(logp.to(DEV), bias.to(DEV), q, q_again, window.to(DEV), 1)
    assert 0 < int(fb_ref.sum()) < rows, "the case must hold rows of both kinds"
    lim = torch.tensor(0.8, device=DEV)
    q_buf = torch.full((rows, k), 9.0, device=DEV)
    again_buf = torch.full((rows, vocab), 9.0, device=DEV)
    logp_out = torch.full((rows, vocab), 7.0, device=DEV)
    drawn = torch.full((2, rows), -5, dtype=torch.int64, device=DEV)
    ras_pick_into(logp.to(DEV), bias.to(DEV), q_buf, again_buf, window.to(DEV), lim, 1, logp_out, drawn, gens=gens,
                  kernel=kernel)
    assert torch.equal(logp_out, logp_ref)
    assert drawn[0].tolist() == tok_ref.tolist() and drawn[1].tolist() == fb_ref.tolist()
    assert torch.equal(q_buf, q)


def test_fallback_never_returns_the_banned_token_and_equal_scores_go_to_the_first_id():
    """A fallback row whose banned distribution is uniform with equal variates: every score ties, so the
    smallest id that is not banned wins (torch's first argmax); the banned id is never drawn."""
    vocab = 40
    logp = torch.full((2, vocab), -torch.log(torch.tensor(float(vocab))))
    logp[0, 0] = 5.0  # row 0's nucleus token is id 0 for sure; banned, id 1 is the first of the equal rest
    logp[1, 3] = 5.0  # row 1's is id 3: id 0 wins the tie
    logp = logp.log_softmax(-1)
    bias, q = torch.zeros(2, vocab), torch.ones(2, 5)
    window = torch.tensor([[0, 0], [3, -1]])
    (_, token, fallback), (_, tok, fb) = _both(logp, bias, q, torch.ones(2, vocab), window, 1)
    assert fb.tolist() == [1, 1] == fallback.long().tolist()
    assert tok.tolist() == [1, 0] == token.tolist()


def test_kernels_refuse_what_they_cannot_take():
    logp = torch.zeros(2, 37, device=DEV).log_softmax(-1)
    probs, q, lim = logp.softmax(-1), torch.ones(2, 5, device=DEV), torch.tensor(0.8, device=DEV)
    drawn = torch.zeros(2, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"window must be \(2, W\) int64"):
        ras_rule.ras_rule_rows(probs, logp, q, lim, torch.zeros(2, 3, device=DEV), 1, drawn)
    with pytest.raises(ValueError, match=r"drawn must be a \(2, 2\) int64"):
        ras_rule.ras_rule_rows(probs, logp, q, lim, torch.zeros(2, 3, dtype=torch.int64, device=DEV), 1,
                               drawn.int())
    with pytest.raises(ValueError, match=r"logp must be \(2, 37\) float32"):
        ras_rule.ras_rule_rows(probs, logp.double(), q, lim, torch.zeros(2, 3, dtype=torch.int64, device=DEV), 1,
                               drawn)
    with pytest.raises(ValueError, match=r"q_again must be \(2, 37\) float32"):
        ras_rule.ras_redraw_rows(probs, torch.ones(2, 36, device=DEV), drawn)
    with pytest.raises(ValueError, match=r"q_again must be \(2, 37\) float32"):
        ras_rule.ras_redraw_rows(probs, None, drawn)  # no variates and no generator states to compute them
    with pytest.raises(ValueError, match=r"gens must be \(2, >= 2\) int64"):
        ras_rule.ras_rule_rows(probs, logp, q, lim, torch.zeros(2, 3, dtype=torch.int64, device=DEV), 1, drawn,
                               gens=torch.zeros(2, 1, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match=r"gens must be \(2, >= 2\) int64"):
        ras_rule.ras_redraw_rows(probs, None, drawn, gens=torch.zeros(3, 2, dtype=torch.int64, device=DEV))


def test_tail_without_the_kernels_writes_the_same():
    """On the torch ops (``kernel=False``, as where Triton cannot run), :func:`ras_pick_into` writes
    :func:`ras_pick_rows`'s values, the kernels' too."""
    logp, bias, q, q_again, window = _case(6, 37, 5, 4, seed=3)
    _, (logp_k, tok_k, fb_k) = _both(logp, bias, q, q_again, window, 1)
    (masked, token, fallback), (logp_t, tok_t, fb_t) = _both(logp, bias, q, q_again, window, 1, kernel=False)
    assert torch.equal(logp_t, masked) and torch.equal(logp_t, logp_k)
    assert tok_t.tolist() == token.tolist() == tok_k.tolist()
    assert fb_t.tolist() == fallback.long().tolist() == fb_k.tolist()


# --------------------------------------------------------------------------------------- the step feed


def test_kernel_layout_is_the_feeds():
    assert (step_feed.TOKEN, step_feed.POS, step_feed.SEED, step_feed.OFFSET, step_feed.WINDOW) == (
        decode_feed.TOKEN, decode_feed.POS, decode_feed.SEED, decode_feed.OFFSET, decode_feed.WINDOW)


def _feed_round(window: int, use_kernels: bool) -> list[torch.Tensor]:
    """A StepFeed through three graph-side rounds: fresh and kept columns, live and idle rows, a position at
    the cache's end (clamped), fallback flags 0 and 1; everything the graph side reads and writes."""
    slots, max_len = 5, 50
    feed = StepFeed(slots, max_len, window, draw_offset=4, device=torch.device(DEV), kernels=use_kernels)
    assert (feed._kernels is not None) == use_kernels
    g = torch.Generator().manual_seed(window)
    out = []
    for rnd in range(3):
        staged = torch.randint(-1, 40, (feed.rows + 2, slots), generator=g)
        staged[feed.rows] = torch.tensor([1, rnd % 2, 0, 1, 1])  # fresh flags
        staged[feed.rows + 1] = torch.tensor([1, 1, rnd % 2, 0, 1])  # live flags
        staged[decode_feed.POS, 0] = max_len - 1 if rnd == 0 else staged[decode_feed.POS, 0].abs()
        feed.staged.copy_(staged.to(DEV))
        n = 4 if rnd < 2 else slots
        tok, pos, gens, win, live = feed.read(n)
        out += [tok.clone(), pos.clone(), gens.clone(), win.clone(), live.clone()]
        drawn = torch.stack([torch.randint(0, 40, (n,), generator=g), torch.tensor([0, 1, 1, 0, 1][:n])]).to(DEV)
        feed.advance(n, drawn, live)
        out.append(feed.step_in.clone())
    return out


@pytest.mark.parametrize("window", [0, 1, 3, 10])
def test_step_feed_kernels_equal_the_torch_ops(window):
    ref = _feed_round(window, False)
    got = _feed_round(window, True)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_step_feed_stage_copies_only_what_the_device_buffer_does_not_hold():
    """A steady batch (no fresh column, the same live rows as the last copy) copies nothing; a fresh column or
    a row joining or leaving copies again.  After every call the graph side reads the live rows and fresh
    columns the host staged."""
    feed = StepFeed(4, 50, 2, draw_offset=4, device=torch.device(DEV))
    col = [7, 3, 11, 8, -1, 5]
    calls = [({0: col, 1: col}, False), ({0: None, 1: None}, False), ({0: None, 1: None}, True),
             ({0: None, 1: None}, True), ({0: None}, False), ({0: None}, True), ({0: None, 2: col}, False),
             ({0: None, 2: None}, False), ({0: None, 2: None}, True)]
    staged = feed.staged
    for columns, skipped in calls:
        s0 = feed.skipped
        staged[:feed.rows] = -99  # column rows a copy would overwrite (the host's are never -99)
        feed.stage(columns)
        copied = bool((staged[:feed.rows] != -99).any())
        assert copied != skipped and feed.skipped - s0 == skipped
        assert staged[feed.rows + 1].tolist() == [int(i in columns) for i in range(4)]
        assert staged[feed.rows].tolist() == [int(columns.get(i) is not None) for i in range(4)]
        for i, c in columns.items():
            if c is not None:
                assert staged[:feed.rows, i].tolist() == c
    assert feed.skipped == 4


def test_advance_writes_each_live_rows_result_into_the_ring_at_its_position():
    """The graph's last kernel puts each live row's token, fallback flag and position at entry ``pos % RING`` of
    its slot in the host ring (what :meth:`StepFeed.take` reads); idle rows and other entries stay as they
    were, and a second step of a row lands in the next entry."""
    feed = StepFeed(4, 50, 2, draw_offset=4, device=torch.device(DEV))
    assert feed._ring is not None and feed._ring.shape == (decode_feed.RING, 3, 5)
    col = {0: [7, 9, 11, 8, -1, 5], 2: [3, 13, 11, 8, -1, 5], 3: [4, 6, 11, 8, -1, 5]}
    feed.stage({0: col[0], 2: col[2]})  # row 3 has a column but is not live this step
    _, _, _, _, live = feed.read(4)
    feed.advance(4, torch.tensor([[21, 22, 23, 24], [0, 0, 1, 0]], device=DEV), live)
    ring = feed._ring.clone()
    assert ring[9 % 4, :, 0].tolist() == [21, 0, 9] and ring[13 % 4, :, 2].tolist() == [23, 1, 13]
    untouched = torch.ones_like(ring, dtype=torch.bool)
    untouched[9 % 4, :, 0] = untouched[13 % 4, :, 2] = False
    assert bool((ring[untouched] == -1).all())
    feed.stage({0: None, 2: None})
    _, _, _, _, live = feed.read(4)
    feed.advance(4, torch.tensor([[31, 32, 33, 34], [0, 0, 0, 0]], device=DEV), live)
    assert feed._ring[10 % 4, :, 0].tolist() == [31, 0, 10] and feed._ring[14 % 4, :, 2].tolist() == [33, 0, 14]
    assert feed._ring[9 % 4, :, 0].tolist() == [21, 0, 9]  # the step before is still there to be read


def test_step_feed_kernels_refuse_bad_buffers():
    inp = torch.zeros(6, 3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"staged must be \(8, 3\) torch.int64"):
        step_feed.read_columns(torch.zeros(7, 3, dtype=torch.int64, device=DEV), inp, 10)
    with pytest.raises(ValueError, match=r"live must be \(3,\) torch.bool"):
        step_feed.advance_columns(inp, torch.zeros(2, 3, dtype=torch.int64, device=DEV),
                                  torch.ones(3, dtype=torch.int64, device=DEV), 10, 4)
    with pytest.raises(ValueError, match=r"ring must be \(D, 3, >= 3\) int64"):
        step_feed.advance_columns(inp, torch.zeros(2, 3, dtype=torch.int64, device=DEV),
                                  torch.ones(3, dtype=torch.bool, device=DEV), 10, 4, torch.zeros(4, 2, 3).long())


# ------------------------------------------------------------------------------------------------ GPU

_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@_gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_fused_tail_equals_the_torch_rule_at_speech_vocab(rows):
    """At V = 6564 and top_k 25, over many random batches on CUDA (torch's CUDA softmax and IEEE division as the
    reference): tokens, flags and masked log-probs equal bit for bit, fallbacks included."""
    fallbacks = 0
    for seed in range(40):
        logp, bias, q, q_again, window = _case(rows, 6564, 25, 10, seed=1000 * rows + seed)
        (masked, token, fallback), (logp_out, tok, fb) = _both(logp, bias, q, q_again, window, 1)
        assert torch.equal(logp_out, masked)
        assert torch.equal(tok, token) and torch.equal(fb, fallback.long())
        fallbacks += int(fb.sum())
    assert fallbacks > 0


@_gpu
def test_gpu_fused_tail_replays_in_a_graph():
    """Captured once and replayed on new inputs, the fused tail gives the torch rule's results each time."""
    rows, vocab = 4, 6564
    logp, bias, q, q_again, window = (t.to(DEV) for t in _case(rows, vocab, 25, 10, seed=5))
    lim = torch.tensor(0.8, device=DEV)
    logp_out = torch.empty(rows, vocab, device=DEV)
    drawn = torch.zeros(2, rows, dtype=torch.int64, device=DEV)
    ras_pick_into(logp, bias, q, q_again, window, lim, 1, logp_out, drawn)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ras_pick_into(logp, bias, q, q_again, window, lim, 1, logp_out, drawn)
    for seed in range(3):
        new = _case(rows, vocab, 25, 10, seed=50 + seed)
        for dst, src in zip((logp, bias, q, q_again, window), new):
            dst.copy_(src)
        graph.replay()
        masked, token, fallback = ras_pick_rows(logp, bias, q, q_again, window, lim, 1)
        assert torch.equal(logp_out, masked) and torch.equal(drawn[0], token)
        assert torch.equal(drawn[1], fallback.long())
