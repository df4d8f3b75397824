"""Repetition-aware sampling inside the batched decode graph: the Philox kernel that recomputes a CUDA
generator's ``exponential_`` draws, the graph-side RAS rule, and the ``cudagraph`` LLM driven with it.

On CPU the kernel runs through Triton's interpreter and is checked against a plain-Python Philox4x32-10
(itself checked against the Random123 known-answer vectors); the backend runs with stand-in CUDA generators
(seed and offset only) against the eager model's loop with the same draws.  The GPU tests check what the CPU
cannot: that the kernel's variates are ``exponential_``'s bit for bit, and the backend's tokens and generator
offsets equal the eager sampler's with real generators.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cosyvoice_fast.llm import graph as cudagraph_llm, graph_slots  # noqa: E402
from cosyvoice_fast.bench.llm_tools import generate_alone  # noqa: E402
from cosyvoice_fast.llm.decode_feed import int64  # noqa: E402
from cosyvoice_fast.llm.nucleus import nucleus_pick_rows, ras_pick_rows  # noqa: E402
from cosyvoice_fast.llm.kernels.philox import DRAW_OFFSET, MAX_ELEMENTS, exponential_rows  # noqa: E402
from cosyvoice_fast.llm.model.sampling import _nucleus_size  # noqa: E402
from test_batched_decode import _CpuGraphLLM, _drive, _inputs, _take, case  # noqa: E402,F401 (case: a fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32_10(ctr: list[int], key: list[int]) -> list[int]:
    """Philox4x32 with ten rounds in plain integers (Salmon et al. 2011), the reference for the kernel."""
    c, k = list(ctr), list(key)
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & _MASK, (p0 >> 32) ^ c[3] ^ k[1], p0 & _MASK]
        k = [(k[0] + _W0) & _MASK, (k[1] + _W1) & _MASK]
    return c


def words(seed: int, offset: int, n: int) -> list[int]:
    """The 32-bit words a CUDA ``exponential_`` of ``n`` elements turns into variates at this generator state."""
    quad = offset >> 2
    key = [seed & _MASK, seed >> 32 & _MASK]
    return [philox4x32_10([quad & _MASK, quad >> 32 & _MASK, i, 0], key)[0] for i in range(n)]


def _state(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([[int64(s) for s, _ in pairs], [o for _, o in pairs]],
                        dtype=torch.long, device=DEV)


PAIRS = [(0, 0), (1234, 8), ((1 << 40) + 7, 4 * (1 << 33) + 4), ((1 << 64) - 3, 4)]


def test_reference_philox_reproduces_the_random123_known_answers():
    assert philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([_MASK] * 4, [_MASK] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
                         [0xA4093822, 0x299F31D0]) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("n", [1, 25, 1030])
@pytest.mark.parametrize("delta", [0, DRAW_OFFSET])
def test_kernel_words_are_philox_of_seed_offset_and_element(n, delta):
    """Seeds past 2**32 and 2**63 (the key's high word, the sign bit of the int64 carrier), offsets past 2**34
    (the counter's high word), several blocks per row."""
    out = torch.full((len(PAIRS), n), -1, dtype=torch.long, device=DEV)
    exponential_rows(_state(PAIRS), out, delta, raw=True)
    for row, (seed, offset) in enumerate(PAIRS):
        assert [w & _MASK for w in out[row].tolist()] == words(seed, offset + delta, n), row


def test_kernel_variates_are_minus_log_of_the_curand_uniform():
    out = torch.empty(len(PAIRS), 300, device=DEV)
    exponential_rows(_state(PAIRS), out)
    x = np.array([words(s, o, 300) for s, o in PAIRS], dtype=np.uint32)
    u = x.astype(np.float32) * np.float32(2.0 ** -32) + np.float32(2.0 ** -33)
    want = -np.log(u.astype(np.float64))
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=2e-6, atol=5e-7)  # lg2.approx / log2: not exact
    assert (out > 0).all()


def test_kernel_refuses_what_it_cannot_draw():
    state = _state(PAIRS[:2])
    with pytest.raises(ValueError, match=f"1 to {MAX_ELEMENTS} elements per row, got {MAX_ELEMENTS + 1}"):
        exponential_rows(state, torch.empty(2, MAX_ELEMENTS + 1, device=DEV))
    with pytest.raises(ValueError, match=r"state must be \(2, >= 3\) int64"):
        exponential_rows(state, torch.empty(3, 8, device=DEV))
    with pytest.raises(ValueError, match="int64"):
        exponential_rows(state.float(), torch.empty(2, 8, device=DEV))


def test_ras_pick_rows_is_the_nucleus_pick_then_the_repetition_rule():
    """Rows whose nucleus token is (not) in their window keep it (redraw from the rest with the second set of
    variates); a fallback never returns the banned token."""
    torch.manual_seed(0)
    b, v, k = 6, 40, 5
    logp = torch.randn(b, v).mul(2.0).log_softmax(-1)
    bias = torch.zeros(b, v)
    bias[:, -2:] = -float("inf")
    q, q_again = torch.empty(b, k).exponential_(), torch.empty(b, v).exponential_()
    limit = torch.tensor(0.8)
    _, nucleus = nucleus_pick_rows(logp, bias, q, limit)
    window = torch.full((b, 4), -1, dtype=torch.long)
    window[0:3, 1] = nucleus[0:3]  # rows 0-2 repeat their token once
    window[1, 2] = nucleus[1]  # row 1 twice
    for repeats, want_fb in ((1, [1, 1, 1, 0, 0, 0]), (2, [0, 1, 0, 0, 0, 0])):
        masked, token, fallback = ras_pick_rows(logp, bias, q, q_again, window, limit, repeats)
        assert fallback.tolist() == [bool(f) for f in want_fb]
        for r in range(b):
            if want_fb[r]:
                banned = masked[r].clone()
                banned[nucleus[r]] = -float("inf")
                assert token[r] == (banned.softmax(0) / q_again[r]).argmax() != nucleus[r]
            else:
                assert token[r] == nucleus[r]
        assert torch.equal(masked, logp + bias)


# ------------------------------------------------------------------------------------------ the backend


class PhiloxGen:
    """A stand-in CUDA generator: only the state device RAS reads and advances (seed and offset)."""

    device = torch.device("cuda")

    def __init__(self, seed: int, offset: int = 0):
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def _draw(gen: PhiloxGen, n: int) -> torch.Tensor:
    """``exponential_`` of ``n`` elements from ``gen``, as the kernel computes it, advancing ``gen``."""
    out = torch.empty(1, n)
    exponential_rows(_state([(gen.seed, gen.offset)]).cpu(), out)
    gen.offset += DRAW_OFFSET
    return out[0]


class PhiloxRas:
    """The eager RAS sampler (:func:`~cosyvoice_fast.llm.model.sampling.ras_sample`) with every multinomial
    written as torch computes it on a CUDA generator (``argmax(p / exponential_)``): the reference."""

    def __init__(self, sampler):
        self.s = sampler

    def __call__(self, logp: torch.Tensor, history: list[int], gen: PhiloxGen) -> int:
        s = self.s
        p, idx = logp.float().softmax(0).sort(descending=True, stable=True)
        head_p, head_i = p[:s.top_k], idx[:s.top_k]
        keep = _nucleus_size(head_p.numpy(), s.top_p)
        token = int(head_i[(head_p[:keep] / _draw(gen, s.top_k)[:keep]).argmax()])
        if history[-s.win_size:].count(token) >= s.win_size * s.tau_r:
            banned = logp.float().clone()
            banned[token] = -float("inf")
            token = int((banned.softmax(0) / _draw(gen, banned.numel())).argmax())
        return token


def _ras_stage(tiny_models, monkeypatch, slots: int, llm=None, **kw):  # noqa: ANN001
    """The ``cudagraph`` LLM with device RAS on the CPU graph maths (interpreter kernels), as these tests drive it."""
    monkeypatch.setattr(cudagraph_llm, "why_unavailable", lambda llm: None)
    return _CpuGraphLLM(llm or tiny_models.llm, tiny_models.config, progress=False, slots=slots, max_len=512,
                        kv_buckets=(128, 256), prefill_buckets=(64,), device_ras=True, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives CPU graph maths through the Triton interpreter; "
                    "on a GPU the gpu tests below use real generators")
def test_cpu_backend_with_device_ras_equals_the_eager_loop_with_the_same_draws(tiny_models, case, monkeypatch):
    """Stand-in CUDA generators through the CPU graph maths (interpreter kernel): every token of solo and
    staggered interleaved requests equals the model's own loop sampling with the same Philox draws, fallbacks
    happen, and each generator ends at the offset the eager draws leave it at."""
    llm = tiny_models.llm
    stage = _ras_stage(tiny_models, monkeypatch, 4)
    assert stage.device_ras
    inputs, text = _inputs(case), case["text"]
    seeds, n = (3, (1 << 63) + 5, 11), (40, 25, 33)
    ref, ref_offsets = [], []
    for s, m in zip(seeds, n):
        gen = PhiloxGen(s)
        ref.append(list(llm.generate(text, inputs.prompt_text, inputs.llm_prompt_speech_token, generator=gen,
                                     sampler=PhiloxRas(llm.default_sampler()), max_tokens=m, ignore_eos=True)))
        ref_offsets.append(gen.offset)
    gen = PhiloxGen(seeds[0])
    assert generate_alone(stage, inputs, text, gen, n[0], True) == ref[0]
    assert gen.offset == ref_offsets[0]
    gens = [PhiloxGen(s) for s in seeds]
    before = stage.fallback_draws
    got = _drive(stage, [(inputs, text, g, m, True) for g, m in zip(gens, n)], [0, 3, 1])
    assert got == ref
    assert [g.offset for g in gens] == ref_offsets
    fallbacks = sum((o // DRAW_OFFSET) - m for o, m in zip(ref_offsets, n))
    assert stage.fallback_draws - before == fallbacks > 0
    assert stage.slots_in_use == 0


def _philox_reference(llm, inputs, text, seed: int, n: int, ignore_eos: bool = True) -> tuple[list[int], int]:
    """The model's own loop with the Philox draws: (tokens, the generator's final offset)."""
    gen = PhiloxGen(seed)
    tokens = list(llm.generate(text, inputs.prompt_text, inputs.llm_prompt_speech_token, generator=gen,
                               sampler=PhiloxRas(llm.default_sampler()), max_tokens=n, ignore_eos=ignore_eos))
    return tokens, gen.offset


#: (seed, max tokens, ignore_eos, start turn, turns sat out): requests join at different turns, three sit out
#: calls (as the engine leaves rows out while a first chunk is solved), request 3 is cancelled at turn 9 and
#: request 4 starts later in its slot, request 1 runs until its stop token
SIT_OUT_JOBS = [(3, 60, True, 0, {5, 6, 7}), (8, None, False, 1, set()), (21, 30, True, 2, {12, 13}),
                (5, 50, True, 3, set()), ((1 << 63) + 1, 25, True, 11, {14})]
CANCEL, CANCEL_TURN = 3, 9


def _eos_prone(llm):
    """A copy of ``llm`` whose stop token wins once it is allowed (random weights never stop on their own)."""
    import copy

    llm = copy.deepcopy(llm)
    with torch.no_grad():
        llm.llm_decoder.bias[llm.cfg.eos_token] += 30.0
    return llm


def _drive_sitting_out(stage, states, monkeypatch) -> tuple[list[list[int]], int]:  # noqa: ANN001
    """Drive :data:`SIT_OUT_JOBS` like the engine (a ``prefill`` of the joiners, then one ``decode`` of the
    running rows per turn): each request's tokens, and how many rows came back from sitting out.  Checks on
    the way that only rows on their first decode step are launched from the host's state: a row back from
    sitting out takes the step launched before it left."""
    jobs = SIT_OUT_JOBS
    launches: list[tuple[bool, list[int]]] = []
    launch = stage._launch
    monkeypatch.setattr(stage, "_launch", lambda rows, ahead, prefilled=False: (
        launches.append((ahead or prefilled, [st.slot for st in rows])), launch(rows, ahead, prefilled))[1])
    got: list[list[int]] = [[] for _ in jobs]
    returning = 0
    take = partial(_take, got)

    turn = 0
    while turn <= CANCEL_TURN or not all(st.done for i, st in enumerate(states) if i != CANCEL):
        if turn == CANCEL_TURN:
            st = states[CANCEL]
            assert stage._feed.pending(st.slot, st, st.step)  # its next step is launched already
            stage.release(st)
        new = [i for i, job in enumerate(jobs) if job[3] == turn]
        take(new, stage.prefill([states[i] for i in new]))
        running = [i for i, job in enumerate(jobs) if job[3] < turn and not states[i].done
                   and turn not in job[4] and states[i].slot is not None]
        returning += sum(turn - 1 in jobs[i][4] for i in running)
        first = {states[i].slot for i in running if jobs[i][3] == turn - 1}
        n0 = len(launches)
        take(running, stage.decode([states[i] for i in running]))
        assert all(set(slots) <= first for ahead, slots in launches[n0:] if not ahead), turn
        turn += 1
    return got, returning


def _check_sitting_out(stage, states, got, returning, ref, ref_offsets, offsets) -> None:  # noqa: ANN001
    keep = [i for i in range(len(SIT_OUT_JOBS)) if i != CANCEL]
    assert [got[i] for i in keep] == [ref[i] for i in keep]
    assert got[CANCEL] == ref[CANCEL][:len(got[CANCEL])] and 5 < len(got[CANCEL]) < 50
    assert [offsets[i] for i in keep] == [ref_offsets[i] for i in keep]
    assert returning == 3
    assert len(got[1]) == states[1].min_len < 60  # stopped at the first step the stop token was allowed
    # every row's first decode step is launched by its prefill; then a row of m tokens (its limit) gets a step
    # ahead in every decode call but its last: m - 2; the stopped and the cancelled row in every call, and
    # exactly those two steps ahead are thrown away
    capped = sum(n - 2 for i, (_, n, eos, _, _) in enumerate(SIT_OUT_JOBS) if eos and i != CANCEL)
    assert stage.ahead_rows == len(SIT_OUT_JOBS) + capped + len(got[1]) + len(got[CANCEL]) - 1
    assert stage._feed.dropped == 2
    assert stage._feed.skipped > 0  # steady stretches staged nothing: the device held their flags already
    assert stage.slots_in_use == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives CPU graph maths through the Triton interpreter")
def test_cpu_decode_ahead_keeps_every_token_through_joins_sit_outs_and_a_cancel(tiny_models, case, monkeypatch):
    """With ``decode_ahead`` each call launches the rows' next step before reading this one.  Through joins,
    rows sitting out, a cancel with a step launched ahead (its slot reused) and a stop token: every token and
    every generator offset equals the model's own loop with the same draws."""
    llm = _eos_prone(tiny_models.llm)
    stage = _ras_stage(tiny_models, monkeypatch, 4, llm)
    assert stage.decode_ahead
    inputs, text = _inputs(case), case["text"]
    ref = [_philox_reference(llm, inputs, text, seed, n, eos) for seed, n, eos, _, _ in SIT_OUT_JOBS]
    gens = [PhiloxGen(seed) for seed, *_ in SIT_OUT_JOBS]
    states = [stage.new_state(inputs, text, g, n, eos) for g, (_, n, eos, _, _) in zip(gens, SIT_OUT_JOBS)]
    got, returning = _drive_sitting_out(stage, states, monkeypatch)
    _check_sitting_out(stage, states, got, returning, [t for t, _ in ref], [o for _, o in ref],
                       [g.offset for g in gens])


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives CPU graph maths through the Triton interpreter")
def test_cpu_decode_ahead_off_launches_each_step_from_the_host(tiny_models, case, monkeypatch):
    llm = tiny_models.llm
    stage = _ras_stage(tiny_models, monkeypatch, 2, decode_ahead=False)
    inputs, text = _inputs(case), case["text"]
    gen = PhiloxGen(77)
    assert generate_alone(stage, inputs, text, gen, 30, True) == _philox_reference(llm, inputs, text, 77, 30)[0]
    assert stage.replays == 29 and stage.ahead_rows == 0 and stage._feed.dropped == 0
    with pytest.raises(ValueError, match="decode_ahead=True needs device_ras"):
        _CpuGraphLLM(llm, tiny_models.config, progress=False, slots=2, max_len=256, kv_buckets=(256,),
                     prefill_buckets=(), decode_ahead=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives CPU graph maths through the Triton interpreter")
def test_cpu_prefill_graph_draws_each_rows_variates_from_its_own_generator(tiny_models, case, monkeypatch):
    """With device RAS the batched prefill draws each row's first-token variates inside its graph, from the
    row's seed and offset: two requests of different lengths prefilled by one replay leave in their slot rows
    exactly what their generators' ``exponential_`` draws at that offset, and each generator is one draw on.
    (Without ``decode_ahead``: with it the first decode step, launched right behind, draws into the same rows.)"""
    stage = _ras_stage(tiny_models, monkeypatch, 2, decode_ahead=False)
    assert stage.prefiller.draws and not stage.prefiller.starts_decode
    inputs, text = _inputs(case), case["text"]
    seeds, offsets = (5, (1 << 63) + 9), (0, 7 * DRAW_OFFSET)
    gens = [PhiloxGen(s, o) for s, o in zip(seeds, offsets)]
    states = [stage.new_state(inputs, t, g, 10, True) for t, g in zip((text, text[:, :2]), gens)]
    calls = stage.prefiller.calls
    stage.prefill(states)
    assert stage.prefiller.calls - calls == 1
    for st, seed, offset in zip(states, seeds, offsets):
        q = stage.pool.item(st.slot).q
        assert torch.equal(q, _draw(PhiloxGen(seed, offset), q.numel()))
    assert [g.offset for g in gens] == [o + DRAW_OFFSET for o in offsets]
    for st in states:
        stage.release(st)


def test_cpu_prefill_launches_the_first_decode_step_before_reading_its_tokens(tiny_models, case, monkeypatch):
    """With ``decode_ahead`` a prefill launches each row's first decode step from the inputs its graph wrote
    (the token it drew, the next position, the generator past its draw, a window of that token) before it reads
    its tokens.  The step is pending after the prefill, the decode call takes it instead of launching it, and
    every token and generator offset equals the model's own loop; a row that its prefill token ends gets none."""
    llm = tiny_models.llm
    stage = _ras_stage(tiny_models, monkeypatch, 3)
    assert stage.prefiller.starts_decode
    inputs, text = _inputs(case), case["text"]
    seeds, n = (41, (1 << 63) + 3), (12, 20)
    refs = [_philox_reference(llm, inputs, t, s, m) for t, s, m in zip((text, text[:, :3]), seeds, n)]
    gens = [PhiloxGen(s) for s in seeds]
    states = [stage.new_state(inputs, t, g, m, True) for t, g, m in zip((text, text[:, :3]), gens, n)]
    replays = stage.replays
    got = [[tok] for tok in stage.prefill(states)]
    assert stage.replays - replays == 1 and stage.ahead_rows == 2  # one decode replay for both rows
    assert all(stage._feed.pending(st.slot, st, 1) for st in states)
    fresh = []
    real_launch = stage._launch
    monkeypatch.setattr(stage, "_launch", lambda rows, ahead, prefilled=False: (
        fresh.append(not (ahead or prefilled)), real_launch(rows, ahead, prefilled))[1])
    while not all(st.done for st in states):
        live = [st for st in states if not st.done]
        for st, tok in zip(live, stage.decode(live)):
            got[states.index(st)].append(tok)
    assert not any(fresh)  # every step came from the device: none from the host's state
    assert got == [r[0] for r in refs] and [g.offset for g in gens] == [r[1] for r in refs]
    assert stage._feed.dropped == 0 and stage.slots_in_use == 0
    one = stage.new_state(inputs, text, PhiloxGen(9), 1, True)  # done with its prefill token
    assert stage.prefill([one])[0] == _philox_reference(llm, inputs, text, 9, 1)[0][0]
    assert one.done and stage.slots_in_use == 0 and stage._feed.dropped == 0  # no step was launched for it


def test_cpu_prefill_starts_no_decode_step_when_the_rule_could_redraw_its_token(tiny_models, case, monkeypatch):
    """A zero repetition threshold redraws every token, a first one too (two draws), so the inputs the prefill
    graph wrote would carry the wrong generator offset: no step is launched behind the prefill, and the tokens
    still equal the model's own loop."""
    import copy
    import dataclasses

    llm = copy.deepcopy(tiny_models.llm)
    llm.cfg = dataclasses.replace(llm.cfg, tau_r=0.0)
    # the host's fallback draw for the prefill's token, with the stand-in generator (as PhiloxRas draws it)
    monkeypatch.setattr(graph_slots, "random_sample",
                        lambda logp, gen: int((logp.float().softmax(0) / _draw(gen, logp.numel())).argmax()))
    stage = _ras_stage(tiny_models, monkeypatch, 2, llm)
    assert stage.prefiller.starts_decode and stage._repeats == 0
    inputs, text = _inputs(case), case["text"]
    gen = PhiloxGen(13)
    st = stage.new_state(inputs, text, gen, 6, True)
    got = stage.prefill([st])
    assert isinstance(got[0], int) and stage.fallback_draws == 1
    assert stage.ahead_rows == 0 and not stage._feed.pending(st.slot, st, 1)
    for _ in range(5):
        got += stage.decode([st])
    assert st.done and stage.slots_in_use == 0
    assert (got, gen.offset) == _philox_reference(llm, inputs, text, 13, 6)


def test_cpu_no_ahead_skips_one_step_ahead_and_keeps_every_token(tiny_models, case, monkeypatch):
    """A decode call for a state with ``no_ahead`` (the engine pauses it after this step) launches nothing ahead
    for it; its next call launches that step from the host.  Tokens and the generator's offset equal the
    model's own loop, and exactly one step ahead fewer is launched than with ``decode_ahead`` throughout."""
    llm = tiny_models.llm
    stage = _ras_stage(tiny_models, monkeypatch, 2)
    assert stage.decode_ahead
    inputs, text = _inputs(case), case["text"]
    n, pause = 30, 10
    ref, ref_offset = _philox_reference(llm, inputs, text, 77, n)
    gen = PhiloxGen(77)
    st = stage.new_state(inputs, text, gen, n, True)
    got = [stage.prefill([st])[0]]
    calls = 0
    while not st.done:
        st.no_ahead = calls == pause
        (token,) = stage.decode([st])
        got.append(token)
        if calls == pause:
            assert not stage._feed.pending(st.slot, st, st.step)  # nothing launched ahead for it
        elif not st.done and calls < n - 3:
            assert stage._feed.pending(st.slot, st, st.step)
        calls += 1
    assert got == ref and gen.offset == ref_offset
    # the prefill launches the first decode step and every call but the last one step ahead (n - 2 of them, see
    # _check_sitting_out), less the paused one
    assert stage.ahead_rows == 1 + n - 3 and stage._feed.dropped == 0 and stage.slots_in_use == 0


def test_device_ras_is_off_on_cpu_by_default_and_refused_where_it_cannot_run(tiny_models, monkeypatch):
    monkeypatch.setattr(cudagraph_llm, "why_unavailable", lambda llm: None)
    kw = dict(progress=False, slots=2, max_len=256, kv_buckets=(256,), prefill_buckets=())
    assert not _CpuGraphLLM(tiny_models.llm, tiny_models.config, **kw).device_ras
    find_spec = cudagraph_llm.importlib.util.find_spec
    monkeypatch.setattr(cudagraph_llm.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ValueError, match="device_ras=True needs the RAS sampler, Triton"):
        _CpuGraphLLM(tiny_models.llm, tiny_models.config, device_ras=True, **kw)


# ------------------------------------------------------------------------------------------ GPU

_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _cuda_draws(n: int, count: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """``count`` generators at assorted seeds and offsets (big ones too): their states, then each one's
    ``exponential_`` of ``n`` elements (checking that it advanced the offset by :data:`DRAW_OFFSET`)."""
    rng = np.random.default_rng(n)
    seeds = [0, 1, (1 << 32) + 5, (1 << 63) + 11, (1 << 64) - 1] + [int(s) for s in rng.integers(0, 1 << 62, count)]
    pairs, refs = [], []
    for i, seed in enumerate(seeds[:count]):
        g = torch.Generator(device="cuda").manual_seed(seed)
        if i % 3 == 1:
            g.set_offset(4 * ((1 << 33) + i))
        for _ in range(i % 4):
            torch.empty(7, device="cuda").exponential_(generator=g)
        pairs.append((seed, g.get_offset()))
        refs.append(torch.empty(n, device="cuda").exponential_(generator=g))
        assert g.get_offset() == pairs[-1][1] + DRAW_OFFSET
    return pairs, torch.stack(refs)


@_gpu
@pytest.mark.parametrize("n", [1, 25, 6564, MAX_ELEMENTS])
def test_gpu_kernel_is_exponential_bit_for_bit(n):
    pairs, ref = _cuda_draws(n, 40)
    out = torch.empty_like(ref)
    exponential_rows(_state(pairs), out)
    bad = out != ref
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} variates differ, e.g. {out[bad][:4].tolist()} " \
                          f"against {ref[bad][:4].tolist()}"


@_gpu
def test_gpu_multinomial_is_argmax_of_p_over_the_kernels_variates():
    """The fallback draw: ``multinomial(p, 1)`` on a CUDA generator equals ``argmax(p / q)`` with the kernel's
    ``q`` at the generator's state, over the whole speech vocabulary."""
    torch.manual_seed(0)
    p = torch.randn(30, 6564, device="cuda").mul(3.0).softmax(-1)
    pairs, got = [], []
    for i in range(30):
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        pairs.append((1000 + i, g.get_offset()))
        got.append(int(torch.multinomial(p[i], 1, replacement=True, generator=g)))
    q = exponential_rows(_state(pairs), torch.empty(30, 6564, device="cuda"))
    assert (p / q).argmax(-1).tolist() == got


@pytest.fixture(scope="module")
def llm_gpu(tiny_models):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import copy

    return copy.deepcopy(tiny_models.llm).cuda()


@_gpu
def test_gpu_device_ras_equals_eager_tokens_and_generator_offsets(llm_gpu, tiny_models, case):
    """Real CUDA generators, staggered interleaved requests (one seed past 2**63): the same tokens as the eager
    backend with fallbacks exercised, and every generator left where the eager draws leave it."""
    from cosyvoice_fast.llm.graph import CudaGraphLLM
    from cosyvoice_fast.llm.eager import EagerLLM

    stage = CudaGraphLLM(llm_gpu, tiny_models.config, slots=4, max_len=512, kv_buckets=(128, 256),
                         progress=False)
    assert stage.device_ras
    eager = EagerLLM(llm_gpu, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    seeds, n = (5, (1 << 63) + 9, 7), (200, 120, 160)

    def gens():
        return [torch.Generator(device="cuda").manual_seed(s) for s in seeds]

    ref_g, got_g = gens(), gens()
    ref = [generate_alone(eager, inputs, text, g, m, True) for g, m in zip(ref_g, n)]
    got = _drive(stage, [(inputs, text, g, m, True) for g, m in zip(got_g, n)], [0, 2, 9])
    assert got == ref
    assert [g.get_offset() for g in got_g] == [g.get_offset() for g in ref_g]
    assert stage.fallback_draws > 0 and stage.slots_in_use == 0


@_gpu
def test_gpu_decode_ahead_equals_eager_through_joins_sit_outs_and_a_cancel(llm_gpu, tiny_models, case,
                                                                          monkeypatch):
    """Real generators, the step after each call's launched before its tokens are read: tokens and generator
    offsets equal the eager backend's through joins, rows sitting out, a cancel and a stop token."""
    from cosyvoice_fast.llm.graph import CudaGraphLLM
    from cosyvoice_fast.llm.eager import EagerLLM

    llm = _eos_prone(llm_gpu)
    stage = CudaGraphLLM(llm, tiny_models.config, slots=4, max_len=512, kv_buckets=(128, 256), progress=False)
    assert stage.decode_ahead
    eager = EagerLLM(llm, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    ref_g = [torch.Generator(device="cuda").manual_seed(seed) for seed, *_ in SIT_OUT_JOBS]
    ref = [generate_alone(eager, inputs, text, g, n, eos) for g, (_, n, eos, _, _) in zip(ref_g, SIT_OUT_JOBS)]
    gens = [torch.Generator(device="cuda").manual_seed(seed) for seed, *_ in SIT_OUT_JOBS]
    states = [stage.new_state(inputs, text, g, n, eos) for g, (_, n, eos, _, _) in zip(gens, SIT_OUT_JOBS)]
    got, returning = _drive_sitting_out(stage, states, monkeypatch)
    _check_sitting_out(stage, states, got, returning, ref, [g.get_offset() for g in ref_g],
                       [g.get_offset() for g in gens])
