"""Batched decoding: per-row positions in the decoder, the per-row nucleus pick, and the batch calls
(``prefill(states)`` / ``decode(states)``) of the eager and ``cudagraph`` LLM backends (on CPU through eager
stand-ins for the graphs; on a GPU for real), driven the way the engine drives them.

GPU tests are marked ``gpu`` and skip without CUDA; run them with ``python -m pytest -m gpu tests/test_batched_decode.py``.
"""

from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch

from cosyvoice_fast.llm import graph as cudagraph_llm
from cosyvoice_fast.llm.graph import CudaGraphLLM
from cosyvoice_fast.llm.nucleus import nucleus_keep, nucleus_keep_rows, nucleus_pick, nucleus_pick_rows
from cosyvoice_fast.llm.eager import EagerLLM
from cosyvoice_fast.bench.llm_tools import generate_alone
from helpers import teacher_forced_logp
from cosyvoice_fast.config.model import QwenConfig
from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder
from cosyvoice_fast.llm.model.sampling import _nucleus_size
from cosyvoice_fast.frontend.request import ModelInputs

HAS_CUDA = torch.cuda.is_available()
_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


# ------------------------------------------------------------------------------------------ CPU: decoder maths


def _tiny_decoder(seed: int = 0) -> Qwen2Decoder:
    cfg = QwenConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=96, vocab_size=50)
    torch.manual_seed(seed)
    dec = Qwen2Decoder(cfg)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    return dec.eval()


def _clone_cache(c: KVCache) -> KVCache:
    out = copy.copy(c)
    out.k = [t.clone() for t in c.k]
    out.v = [t.clone() for t in c.v]
    return out


@torch.inference_mode()
@pytest.mark.parametrize("t", [1, 3])
def test_forward_rows_equals_each_row_alone(t):
    """Rows at very different positions (and an idle row parked at max_len - 1) stepped together equal each
    row run alone through the ordinary shared-position path, in outputs and in what they write."""
    dec = _tiny_decoder()
    hidden, max_len, bucket = dec.cfg.hidden_size, 96, 96
    lens = [5, 1, 80, 33]  # prefix length per row; row 4 is idle
    n_rows = len(lens) + 1
    cache = KVCache.for_config(dec.cfg, max_len, batch=n_rows)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lens):  # prefill each row through its row view (batch-1, shared positions)
        dec(torch.randn(1, n, hidden, generator=g), torch.arange(n), cache.row(i), kv_len=n)
    before = _clone_cache(cache)
    x = torch.randn(n_rows, t, hidden, generator=g)
    starts = lens + [max_len - t]
    pos = torch.stack([torch.arange(p, p + t) for p in starts])
    got = dec(x, pos, cache, kv_len=bucket)  # dispatches to forward_rows
    assert got.shape == (n_rows, t, hidden)
    for i, p in enumerate(starts):
        alone = _clone_cache(before).row(i)
        ref = dec(x[i:i + 1], torch.arange(p, p + t), alone, kv_len=bucket)
        assert (got[i] - ref[0]).abs().max().item() <= 1e-5, f"row {i}"
        for layer in range(dec.cfg.num_hidden_layers):  # same cache writes, nothing else in the row touched
            assert (cache.k[layer][i] - alone.k[layer][0]).abs().max().item() <= 1e-5
            assert (cache.v[layer][i] - alone.v[layer][0]).abs().max().item() <= 1e-5
            assert torch.equal(cache.k[layer][i, :, :p], before.k[layer][i, :, :p])


@torch.inference_mode()
def test_forward_rows_without_cache_and_shape_checks():
    dec = _tiny_decoder()
    x = torch.randn(2, 4, dec.cfg.hidden_size)
    pos = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]])
    got = dec(x, pos)
    for i in range(2):
        assert (got[i] - dec(x[i:i + 1], pos[i])[0]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="do not match"):
        dec(x, pos[:, :2])
    cache = KVCache.for_config(dec.cfg, 16, batch=3)
    with pytest.raises(ValueError, match="per-row positions for 2 rows"):
        dec(x, pos, cache)
    with pytest.raises(IndexError):
        cache.row(3)


def test_row_views_share_storage():
    cache = KVCache(2, 3, 2, 8, 4)
    view = cache.row(1)
    assert view.batch == 1 and view.max_len == 8 and view.k[0].shape == (1, 2, 8, 4)
    view.update(0, torch.tensor([2]), torch.ones(1, 2, 1, 4), torch.full((1, 2, 1, 4), 2.0))
    assert cache.k[0][1, :, 2].eq(1).all() and cache.v[0][1, :, 2].eq(2).all()
    assert cache.k[0].sum() == 8 and cache.k[1].sum() == 0


# ------------------------------------------------------------------------------------------ CPU: sampling


def test_nucleus_pick_rows_equals_per_row_pick():
    g = torch.Generator().manual_seed(3)
    vocab, k = 300, 25
    for b in (1, 2, 7):
        logp = (torch.randn(b, vocab, generator=g) * torch.tensor([0.5, 2.0, 6.0]).repeat(3)[:b, None]).log_softmax(-1)
        bias = torch.zeros(b, vocab)
        bias[0, 5] = -float("inf")  # per-row masks: eos on row 0, all stop ids on the last row
        bias[-1, 290:] = -float("inf")
        q = torch.empty(b, k).exponential_(1.0, generator=g)
        limit = torch.tensor(0.8)
        masked, tokens = nucleus_pick_rows(logp, bias, q, limit)
        assert tokens.shape == (b,) and tokens.dtype == torch.long
        for i in range(b):
            m1, t1 = nucleus_pick(logp[i], bias[i], q[i], limit)
            assert torch.equal(masked[i], m1) and tokens[i].item() == t1.item()
        assert tokens[-1].item() < 290


def test_lm_input_rows_equals_build_lm_input_on_each_prompts_positions(tiny_models, case):
    """The batched prefill's in-graph gather: prompts in the three modes' layouts (zero-shot, no prompt, no
    prompt speech) in one id batch, stale ids everywhere else, give :meth:`build_lm_input`'s rows exactly on
    their own positions; ``lm_input_length`` is its length."""
    llm = tiny_models.llm
    empty = torch.zeros(1, 0, dtype=torch.int32)
    text = case["text"]
    prompts = [(text, case["prompt_text"], case["prompt_speech_token"]), (text, empty, empty),
               (text[:, :3], case["prompt_text"], None)]
    with torch.inference_mode():
        refs = [llm.build_lm_input(*p) for p in prompts]
        assert [llm.lm_input_length(*p) for p in prompts] == [r.shape[1] for r in refs]
        n = max(r.shape[1] for r in refs) + 4
        top = max(llm.decoder.embed_tokens.num_embeddings, llm.speech_embedding.num_embeddings)
        ids = torch.randint(0, top, (len(prompts), n), generator=torch.Generator().manual_seed(0),
                            dtype=torch.int32)  # stale ids of either table, also where a prompt puts its own
        n_text = []
        for j, (t, pt, sp) in enumerate(prompts):
            t = torch.cat([x.reshape(-1) for x in (pt, t) if x is not None])
            sp = empty.reshape(-1) if sp is None else sp.reshape(-1)
            ids[j, 1:1 + t.numel()] = t
            ids[j, 2 + t.numel():2 + t.numel() + sp.numel()] = sp
            n_text.append(t.numel())
        got = llm.lm_input_rows(ids, torch.tensor(n_text))
    assert got.shape == (len(prompts), n, llm.cfg.llm_input_size)
    for j, ref in enumerate(refs):
        assert torch.equal(got[j, :ref.shape[1]], ref[0])


def test_nucleus_keep_rows_is_nucleus_keep_per_row():
    g = torch.Generator().manual_seed(0)
    limit = torch.tensor(0.8)
    rows = torch.stack([(torch.randn(2000, generator=g) * t).softmax(0).sort(descending=True).values[:25]
                        for t in (0.3, 1.0, 3.0, 10.0) for _ in range(5)])
    keep = nucleus_keep_rows(rows, limit)
    for i in range(rows.shape[0]):
        assert torch.equal(keep[i], nucleus_keep(rows[i], limit))
        assert int(keep[i].sum()) == _nucleus_size(rows[i].numpy(), 0.8)
    assert torch.equal(nucleus_keep_rows(rows[:1], limit)[0], nucleus_keep(rows[0], limit))


# ------------------------------------------------------------------------------------------ CPU: the backend


class _EagerReplay:
    """Stands in for a captured graph: replaying runs the same maths eagerly (CPU tests of the bookkeeping)."""

    def __init__(self, fn):
        self.replay = fn


class _CpuGraphLLM(CudaGraphLLM):
    def _capture_all(self, progress: bool, defer: bool = False) -> int:  # every graph (no background here)
        jobs = self._graph_jobs()
        for where, key, math in jobs:
            where[key] = _EagerReplay(math)
        return len(jobs)


def _inputs(case: dict) -> ModelInputs:
    return ModelInputs(text_segments=[case["text"]], prompt_text=case["prompt_text"],
                       llm_prompt_speech_token=case["prompt_speech_token"])


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_llm")


@pytest.fixture
def cpu_stage(tiny_models, monkeypatch):
    monkeypatch.setattr(cudagraph_llm, "why_unavailable", lambda llm: None)

    def make(**kw):
        return _CpuGraphLLM(tiny_models.llm, tiny_models.config, progress=False, **kw)
    return make


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _take(out: list[list[int]], idx: list[int], results: list) -> None:
    """Append each request's token of a prefill or decode call (``results[j]`` belongs to request ``idx[j]``; None:
    the request ended without one); no result may be an error."""
    for i, r in zip(idx, results):
        assert not isinstance(r, BaseException), r
        if r is not None:
            out[i].append(r)


def _drive(stage, jobs: list[tuple], starts: list[int] | None = None) -> list[list[int]]:
    """Drive requests like the engine: each turn, one ``prefill`` over the requests starting this turn, then one
    ``decode`` over every running one.  ``jobs``: ``(inputs, text, generator, max_tokens, ignore_eos)``; request
    i starts at turn ``starts[i]``."""
    starts = starts or [0] * len(jobs)
    states = [stage.new_state(*job) for job in jobs]
    out: list[list[int]] = [[] for _ in jobs]
    take = partial(_take, out)

    turn = 0
    while turn <= max(starts) or not all(st.done for st in states):
        running = [i for i, st in enumerate(states) if starts[i] < turn and not st.done]
        new = [i for i, st in enumerate(states) if starts[i] == turn and not st.done]
        take(new, stage.prefill([states[i] for i in new]))
        take(running, stage.decode([states[i] for i in running]))
        turn += 1
    return out


def _alone(stage, inputs, text, seed, n, ignore_eos, device="cpu") -> list[int]:
    return generate_alone(stage, inputs, text, _gen(seed, device), n, ignore_eos)


def test_cpu_backend_tokens_equal_eager_solo_and_interleaved(cpu_stage, tiny_models, case):
    """CPU generators: the eager sampler draws from the batched graph maths' log-probs; tokens must be eager's."""
    stage = cpu_stage(slots=5, max_len=512, kv_buckets=(64, 128, 256), prefill_buckets=(64,))
    eager = EagerLLM(tiny_models.llm, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    seeds, n = (3, 4, 5, 6), (30, 45, 12, 60)
    ref = [_alone(eager, inputs, text, s, m, True) for s, m in zip(seeds, n)]
    natural = _alone(eager, inputs, text, 9, None, False)
    assert natural == list(tiny_models.llm.generate(text, inputs.prompt_text, inputs.llm_prompt_speech_token,
                                                    generator=_gen(9)))  # the eager backend is the model's loop
    assert _alone(stage, inputs, text, 9, None, False) == natural
    assert _alone(stage, inputs, text, 3, 30, True) == ref[0]
    steps0, rows0 = stage.batched_steps, stage.batched_rows
    starts = [0, 0, 7, 2]
    jobs = [(inputs, text, _gen(s), m, True) for s, m in zip(seeds, n)]
    assert _drive(eager, jobs, starts) == ref  # the eager backend batched by looping rows
    jobs = [(inputs, text, _gen(s), m, True) for s, m in zip(seeds, n)]
    got = _drive(stage, jobs, starts)  # staggered joins, different lengths: leavers mid-way
    assert got == ref
    assert stage.slots_in_use == 0
    # request i draws decode tokens in turns start+1 .. start+n-1; one batched step per such turn
    turns = set().union(*(range(s0 + 1, s0 + m) for s0, m in zip(starts, n)))
    assert stage.batched_steps - steps0 == len(turns) == 61
    assert stage.batched_rows - rows0 == sum(m - 1 for m in n)


def test_cpu_backend_release_mid_way_and_teacher_forcing(cpu_stage, tiny_models, case):
    """A state released mid-way (the engine cancelling it) gives its slot back and is never stepped again; a
    later state reuses the slot; teacher forcing replays the batched graph beside a busy row."""
    stage = cpu_stage(slots=3, max_len=256, kv_buckets=(64, 128), prefill_buckets=(64,))
    eager = EagerLLM(tiny_models.llm, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    a = stage.new_state(inputs, text, _gen(1), 40, True)
    b = stage.new_state(inputs, text, _gen(2), 40, True)
    stage.prefill([a, b])
    assert (a.slot, b.slot) == (0, 1) and stage.free_slots() == 1
    stage.decode([a, b])
    got_b = list(b.history)
    stage.release(b)  # b is cancelled: slot 1 is free again
    assert stage.slots_in_use == 1 and b.slot is None
    stage.release(b)  # idempotent
    rows0 = stage.batched_rows
    c = stage.new_state(inputs, text, _gen(7), 40, True)
    assert c.slot is None and stage.slots_in_use == 1  # a new state holds nothing until prefill
    for _ in range(9):
        stage.decode([a])
    assert stage.batched_rows - rows0 == 9
    stage.prefill([c])
    assert c.slot == 1  # the released slot, reused
    while not c.done:
        stage.decode([c] + ([a] if not a.done else []))
    while not a.done:
        stage.decode([a])
    got_a, got_c = a.history, c.history
    assert got_a == _alone(eager, inputs, text, 1, 40, True)
    assert got_b == _alone(eager, inputs, text, 2, 40, True)[:2]
    assert got_c == _alone(eager, inputs, text, 7, 40, True)
    assert stage.slots_in_use == 0
    with torch.inference_mode():
        x = tiny_models.llm.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
    busy = stage.new_state(inputs, text, _gen(1), 40, True)
    stage.prefill([busy])  # another request holds a row while teacher forcing replays the batched step
    rows = teacher_forced_logp(stage, x, case["forced_tokens"].tolist())
    ref = torch.cat([case["logp_first"][None], case["forced_logp"]])
    assert (rows - ref).abs().max().item() <= 1e-4
    assert stage.decode([busy]) == _alone(eager, inputs, text, 1, 40, True)[1:2]
    stage.release(busy)
    assert stage.slots_in_use == 0


def test_cpu_batched_prefill_fills_free_slots_in_one_replay_beside_a_running_row(cpu_stage, tiny_models, case):
    """Requests of different input lengths starting together are prefilled by one replay into whichever slots are
    free (here not the first rows), while an earlier request keeps decoding from its own cache row; every
    request draws its solo tokens.  With fewer rows per replay the same call takes ceil(n / rows) replays."""
    inputs, text = _inputs(case), case["text"]
    lengths = (text.shape[1], max(1, text.shape[1] // 2), max(1, text.shape[1] - 3))
    texts = [text[:, :k] for k in lengths]
    with torch.inference_mode():
        n_in = max(tiny_models.llm.build_lm_input(t, case["prompt_text"], case["prompt_speech_token"]).shape[1]
                   for t in texts)
    eager = EagerLLM(tiny_models.llm, tiny_models.config)
    ref_a = _alone(eager, inputs, text, 11, 25, True)
    refs = [_alone(eager, inputs, t, 20 + i, 18, True) for i, t in enumerate(texts)]
    for rows_per_replay, replays in ((len(texts), 1), (2, 2)):
        stage = cpu_stage(slots=5, max_len=4 * n_in, kv_buckets=(4 * n_in,), prefill_buckets=(n_in,),
                          prefill_tokens=rows_per_replay * n_in)
        a = stage.new_state(inputs, text, _gen(11), 25, True)
        b = stage.new_state(inputs, text, _gen(12), 25, True)
        stage.prefill([a])
        stage.prefill([b])
        stage.decode([a, b])
        stage.release(b)  # slot 1 frees; the newcomers take slots 1, 2, 3
        news = [stage.new_state(inputs, t, _gen(20 + i), 18, True) for i, t in enumerate(texts)]
        calls0 = stage.prefiller.calls
        first = stage.prefill(news)
        assert sorted(st.slot for st in news) == [1, 2, 3]
        assert stage.prefiller.calls - calls0 == replays and stage.prefiller.rows_done == 2 + len(texts)
        assert first == [r[0] for r in refs]
        running = [a] + news
        while any(not st.done for st in running):
            stage.decode([st for st in running if not st.done])
        assert a.history == ref_a
        assert [st.history for st in news] == refs
        assert stage.slots_in_use == 0


def test_cpu_backend_row_errors_stay_in_their_row(cpu_stage, tiny_models, case):
    """A row whose prompt does not fit its slot fails alone; the other rows of the call get their tokens."""
    stage = cpu_stage(slots=2, max_len=64, kv_buckets=(64,), prefill_buckets=(64,))
    inputs, text = _inputs(case), case["text"]
    ok = stage.new_state(inputs, text, _gen(1), 5, True)
    too_long = stage.new_state(inputs, text, _gen(2), 80, True)  # 80 forced tokens cannot fit 64 positions
    res = stage.prefill([too_long, ok])
    assert "KV positions" in str(res[0]) and isinstance(res[1], int)
    assert too_long.slot is None and stage.slots_in_use == 1
    stage.release(ok)


# ------------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def llm_cuda(tiny_models):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return copy.deepcopy(tiny_models.llm).cuda()


@pytest.fixture(scope="module")
def batched(llm_cuda, tiny_models):
    return CudaGraphLLM(llm_cuda, tiny_models.config, slots=5, max_len=512, kv_buckets=(64, 128, 256),
                        progress=False)


def _run(stage, inputs, text, seed, n=None, ignore_eos=False, device="cuda"):
    return generate_alone(stage, inputs, text, _gen(seed, device), n, ignore_eos)


@_gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_batched_tokens_equal_eager_fp32_solo(batched, llm_cuda, tiny_models, case, seed):
    eager = EagerLLM(llm_cuda, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    assert _run(batched, inputs, text, seed) == _run(eager, inputs, text, seed)
    assert _run(batched, inputs, text, seed, 400, True) == _run(eager, inputs, text, seed, 400, True)
    assert batched.slots_in_use == 0


@_gpu
def test_gpu_batched_interleaved_equal_eager_and_share_steps(batched, llm_cuda, tiny_models, case):
    eager = EagerLLM(llm_cuda, tiny_models.config)
    inputs, text = _inputs(case), case["text"]
    seeds = (21, 22, 23, 24)
    ref = [_run(eager, inputs, text, s, 20, True) for s in seeds]
    steps0, rows0, fb0 = batched.batched_steps, batched.batched_rows, batched.fallback_draws
    prefills0 = batched.prefiller.calls
    assert _drive(batched, [(inputs, text, _gen(s, "cuda"), 20, True) for s in seeds]) == ref
    assert batched.prefiller.calls - prefills0 == 1  # the four prompts in one batched prefill replay
    assert batched.batched_steps - steps0 == 19  # not 4 x 19
    assert batched.batched_rows - rows0 == 4 * 19
    # staggered joins, mixed lengths, natural eos, a CPU-generator row among CUDA ones
    ref = [_run(eager, inputs, text, 31, 300, True), _run(eager, inputs, text, 32),
           _run(eager, inputs, text, 33, 150, True, "cpu"), _run(eager, inputs, text, 34, 380, True)]
    jobs = [(inputs, text, _gen(31, "cuda"), 300, True), (inputs, text, _gen(32, "cuda"), None, False),
            (inputs, text, _gen(33, "cpu"), 150, True), (inputs, text, _gen(34, "cuda"), 380, True)]
    assert _drive(batched, jobs, starts=[0, 5, 40, 90]) == ref
    assert batched.fallback_draws > fb0 and batched.slots_in_use == 0


@_gpu
def test_gpu_batched_teacher_forcing_with_a_busy_neighbour(batched, llm_cuda, case):
    inputs, text = _inputs(case), case["text"]
    busy = batched.new_state(inputs, text, _gen(5, "cuda"), 100, True)
    batched.prefill([busy])
    batched.decode([busy])
    batched.decode([busy])
    first = list(busy.history)
    with torch.inference_mode():
        x = llm_cuda.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
    rows = teacher_forced_logp(batched, x, case["forced_tokens"].tolist()).cpu()
    ref = torch.cat([case["logp_first"][None], case["forced_logp"]])
    assert (rows - ref).abs().max().item() <= 1e-4
    while not busy.done:  # the neighbour's idle replays did not disturb it
        batched.decode([busy])
    assert first == busy.history[:3] and busy.history == _run(batched, inputs, text, 5, 100, True)


@_gpu
def test_gpu_nucleus_keep_rows_is_the_host_loop_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    limit = torch.tensor(0.8, device="cuda")
    cases = [(torch.randn(6564, generator=g) * t).softmax(0).sort(descending=True).values[:25]
             for t in (0.5, 1.0, 2.0, 4.0, 8.0) for _ in range(40)]
    for base in (0.1, 0.05, 0.04, 0.032, 0.0333333):
        p = torch.full((25,), base) * (1 + 1e-7 * torch.randn(25, generator=g))
        cases.append(p.sort(descending=True).values)
    rows = torch.stack(cases)
    for b in (1, 16, rows.shape[0]):
        keep = nucleus_keep_rows(rows[:b].cuda(), limit).cpu()
        for i in range(b):
            assert int(keep[i].sum()) == _nucleus_size(rows[i].numpy().astype(np.float32), 0.8)
            assert torch.equal(keep[i], nucleus_keep(rows[i].cuda(), limit).cpu())


@_gpu
def test_gpu_nucleus_pick_rows_equals_per_row_pick():
    g = torch.Generator(device="cuda").manual_seed(0)
    b, vocab = 16, 6564
    logp = (torch.randn(b, vocab, device="cuda", generator=g) * 3).log_softmax(-1)
    bias = torch.zeros(b, vocab, device="cuda")
    bias[::2, 6561] = -float("inf")
    q = torch.empty(b, 25, device="cuda").exponential_(1.0, generator=g)
    limit = torch.tensor(0.8, device="cuda")
    masked, tokens = nucleus_pick_rows(logp, bias, q, limit)
    for i in range(b):
        m1, t1 = nucleus_pick(logp[i], bias[i], q[i], limit)
        assert torch.equal(masked[i], m1) and tokens[i].item() == t1.item()
