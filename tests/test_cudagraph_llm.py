"""The ``cudagraph`` LLM backend: slot accounting and helpers on CPU; token parity with eager on a GPU.

GPU tests are marked ``gpu`` and skip without CUDA; run them with ``python -m pytest -m gpu tests/test_cudagraph_llm.py``.
"""

from __future__ import annotations

import copy
import threading
from itertools import islice

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.bench.llm_tools import generate_alone, iter_alone
from helpers import teacher_forced_logp
from cosyvoice_fast.llm.graph import CudaGraphLLM
from cosyvoice_fast.llm.buckets import bucket_for, choose_kv_buckets, prefill_row_counts, token_budget
from cosyvoice_fast.llm.nucleus import nucleus_keep, nucleus_pick
from cosyvoice_fast.llm.eager import EagerLLM
from cosyvoice_fast.llm.kv_pool import PoolExhausted, SlotPool
from cosyvoice_fast.config.model import full_config, tiny_config
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.llm.model.kv_cache import KVCacheFullError
from cosyvoice_fast.llm.model.sampling import _nucleus_size
from cosyvoice_fast.frontend.request import ModelInputs

HAS_CUDA = torch.cuda.is_available()
_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


# ------------------------------------------------------------------------------------------ CPU: pool and helpers


def test_pool_hands_out_lowest_free_slot_and_refuses_when_full():
    pool = SlotPool(["a", "b", "c"], name="LLM slot")
    assert [pool.acquire() for _ in range(3)] == [(0, "a"), (1, "b"), (2, "c")]
    assert pool.in_use == 3
    with pytest.raises(PoolExhausted, match="all 3 LLM slots are in use"):
        pool.acquire()
    pool.release(1)
    assert pool.in_use == 2 and pool.acquire() == (1, "b")
    pool.release(0)
    pool.release(2)
    assert pool.acquire() == (0, "a")  # lowest first, whatever the release order


def test_pool_release_mistakes_raise():
    pool = SlotPool([object(), object()])
    idx, _ = pool.acquire()
    pool.release(idx)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(idx)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(5)
    with pytest.raises(ValueError, match="at least one slot"):
        SlotPool([])


def test_pool_threads_never_share_a_slot():
    pool = SlotPool(list(range(8)))
    held: list[int] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            try:
                i, _ = pool.acquire()
            except PoolExhausted:
                continue
            with lock:
                if i in held:
                    errors.append(RuntimeError(f"slot {i} handed out twice"))
                held.append(i)
            with lock:
                held.remove(i)
            pool.release(i)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.in_use == 0


def test_kv_buckets_and_lookup():
    assert choose_kv_buckets(2048) == (256, 512, 1024, 2048)
    assert choose_kv_buckets(1000) == (256, 512, 1000)
    assert choose_kv_buckets(200) == (200,)
    assert choose_kv_buckets(512, [64, 128, 64]) == (64, 128, 512)
    with pytest.raises(ValueError, match="must lie in"):
        choose_kv_buckets(512, [1024])
    b = (64, 128, 512)
    assert [bucket_for(b, p) for p in (0, 63, 64, 127, 128, 511)] == [64, 64, 128, 128, 512, 512]
    with pytest.raises(KVCacheFullError):
        bucket_for(b, 512)


def test_prefill_row_counts_stay_within_the_token_cap_and_the_slots():
    assert prefill_row_counts(64, 128, 4096) == (1, 2, 4, 8, 16, 32)
    assert prefill_row_counts(64, 512, 4096) == (1, 2, 4, 8)
    assert prefill_row_counts(6, 64, 4096) == (1, 2, 4, 6)  # a last partial power of two: all slots at once
    assert prefill_row_counts(16, 1024, 512) == (1,)  # longer than the cap: still one row
    with pytest.raises(ValueError, match="slots, length and max_tokens"):
        prefill_row_counts(0, 64, 4096)


def test_token_budget_fits_or_explains():
    assert token_budget(100, 500, 2048, ignore_eos=False) == 500
    assert token_budget(48, 2001, 2048, ignore_eos=True) == 2001  # writes 48 + 2001 - 1 = 2048 positions
    assert token_budget(100, 3000, 2048, ignore_eos=False) == 1949  # safety cap shortened to the slot
    with pytest.raises(KVCacheFullError, match="2050 KV positions"):
        token_budget(48, 2003, 2048, ignore_eos=True)
    with pytest.raises(KVCacheFullError, match="larger max_len"):
        token_budget(3000, 10, 2048, ignore_eos=False)


def test_nucleus_keep_is_a_prefix_like_the_host_loop():
    """Typical distributions on CPU (exact fp32 agreement at razor-thin boundaries is a GPU test)."""
    g = torch.Generator().manual_seed(0)
    limit = torch.tensor(0.8)
    for temp in (0.3, 1.0, 3.0, 10.0):
        for _ in range(20):
            p = (torch.randn(6564, generator=g) * temp).softmax(0).sort(descending=True).values[:25]
            keep = nucleus_keep(p, limit)
            n = int(keep.sum())
            assert keep[:n].all() and not keep[n:].any()
            assert n == _nucleus_size(p.numpy(), 0.8)
    assert nucleus_keep(torch.tensor([0.9, 0.05, 0.05]), limit).tolist() == [True, False, False]
    assert nucleus_keep(torch.tensor([0.5, 0.3, 0.2]), torch.tensor(0.0)).tolist() == [True, False, False]


def test_nucleus_pick_is_the_multinomial_rule_on_the_kept_candidates():
    g = torch.Generator().manual_seed(1)
    logp = (torch.randn(100, generator=g) * 2).log_softmax(0)
    bias = torch.zeros(100)
    bias[7] = -float("inf")
    q = torch.empty(25).exponential_(1.0, generator=g)
    masked, token = nucleus_pick(logp, bias, q, torch.tensor(0.8))
    assert masked[7] == -float("inf") and torch.equal(masked[:7], logp[:7])
    p, idx = masked.softmax(0).sort(descending=True, stable=True)
    n = _nucleus_size(p[:25].numpy(), 0.8)
    assert token.tolist() == [int(idx[(p[:n] / q[:n]).argmax()])]
    assert token.item() != 7


def test_unavailable_for_a_cpu_model_says_why():
    llm = Qwen2LM(tiny_config().llm)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        CudaGraphLLM(llm, tiny_config())


# ------------------------------------------------------------------------------------------ GPU


def _inputs(case: dict) -> ModelInputs:
    return ModelInputs(text_segments=[case["text"]], prompt_text=case["prompt_text"],
                       llm_prompt_speech_token=case["prompt_speech_token"])


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_llm")


@pytest.fixture(scope="module")
def llm_cuda(tiny_models):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return copy.deepcopy(tiny_models.llm).cuda()


@pytest.fixture(scope="module")
def backend(llm_cuda, tiny_models):
    # small buckets so a few hundred tokens cross every one of them
    return CudaGraphLLM(llm_cuda, tiny_models.config, slots=3, max_len=512, kv_buckets=(64, 128, 256),
                        progress=False)


def _run(stage, inputs, case, seed, n=None, ignore_eos=False, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return generate_alone(stage, inputs, case["text"], g, n, ignore_eos)


@_gpu
def test_gpu_teacher_forced_logp_matches_upstream(backend, llm_cuda, case):
    with torch.inference_mode():
        x = llm_cuda.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
    forced = case["forced_tokens"].tolist()
    rows = teacher_forced_logp(backend, x, forced).cpu()
    ref = torch.cat([case["logp_first"][None], case["forced_logp"]])
    assert (rows - ref).abs().max().item() <= 1e-4
    assert backend.slots_in_use == 0


@_gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_tokens_equal_eager_fp32(backend, llm_cuda, tiny_models, case, seed):
    eager = EagerLLM(llm_cuda, tiny_models.config)
    inputs = _inputs(case)
    before = backend.fallback_draws
    assert _run(backend, inputs, case, seed) == _run(eager, inputs, case, seed)  # natural length (eos rules)
    forced = _run(backend, inputs, case, seed, 400, True)  # 37 + 400 positions: crosses every kv bucket
    assert len(forced) == 400 and forced == _run(eager, inputs, case, seed, 400, True)
    assert backend.fallback_draws > before  # the RAS repetition fallback was exercised too
    assert backend.slots_in_use == 0


@_gpu
def test_gpu_eager_prefill_path_for_long_inputs(llm_cuda, tiny_models, case):
    """Inputs longer than every captured prefill length take the eager SDPA prefill; same tokens, same log-probs."""
    stage = CudaGraphLLM(llm_cuda, tiny_models.config, slots=1, max_len=256, prefill_buckets=(16,), progress=False)
    eager = EagerLLM(llm_cuda, tiny_models.config)
    inputs = _inputs(case)
    assert _run(stage, inputs, case, 5, 100, True) == _run(eager, inputs, case, 5, 100, True)
    with torch.inference_mode():
        x = llm_cuda.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
    rows = teacher_forced_logp(stage, x, case["forced_tokens"].tolist()).cpu()
    ref = torch.cat([case["logp_first"][None], case["forced_logp"]])
    assert (rows - ref).abs().max().item() <= 1e-4


@_gpu
def test_gpu_cpu_generator_matches_eager(backend, llm_cuda, tiny_models, case):
    eager = EagerLLM(llm_cuda, tiny_models.config)
    args = (_inputs(case), case, 4, 60, True, "cpu")
    assert _run(backend, *args) == _run(eager, *args)


@_gpu
def test_gpu_interleaved_requests_equal_each_alone(backend, case):
    inputs = _inputs(case)
    alone = [_run(backend, inputs, case, s, 50, True) for s in (11, 12)]
    states = [backend.new_state(inputs, case["text"], torch.Generator("cuda").manual_seed(s), 50, True)
              for s in (11, 12)]
    backend.prefill(states)
    assert backend.slots_in_use == 2
    while not all(st.done for st in states):
        backend.decode(states)
    assert [st.history for st in states] == alone and alone[0] != alone[1]
    assert backend.slots_in_use == 0  # done states gave their slots back


@_gpu
def test_gpu_release_frees_the_slot_and_a_full_pool_says_so(backend, case):
    """The engine never passes more states than free slots; if something did, the pool says so."""
    inputs = _inputs(case)

    def start(seed: int):
        st = backend.new_state(inputs, case["text"], torch.Generator("cuda").manual_seed(seed), 100, True)
        (res,) = backend.prefill([st])
        return st, res

    never_started = backend.new_state(inputs, case["text"], torch.Generator("cuda"), 10, True)
    states = [start(s)[0] for s in range(3)]
    assert backend.slots_in_use == 3 and backend.free_slots() == 0
    st, res = start(3)
    assert isinstance(res, PoolExhausted) and "all 3 LLM slots are in use" in str(res) and st.slot is None
    backend.release(states[1])
    assert backend.slots_in_use == 2
    states.append(start(4)[0])
    for st in states + [never_started]:
        backend.release(st)
    assert backend.slots_in_use == 0


@_gpu
def test_gpu_nucleus_cut_is_the_host_loop_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    limit = torch.tensor(0.8, device="cuda")
    cases = [(torch.randn(6564, generator=g) * t).softmax(0).sort(descending=True).values[:25]
             for t in (0.5, 1.0, 2.0, 4.0, 8.0) for _ in range(40)]
    # Adversarial: many small equal-ish terms whose running sum straddles 0.8 within a few ulps.
    for base in (0.1, 0.05, 0.04, 0.032, 0.0333333):
        p = torch.full((25,), base) * (1 + 1e-7 * torch.randn(25, generator=g))
        cases.append(p.sort(descending=True).values)
    for p in cases:
        n_gpu = int(nucleus_keep(p.cuda(), limit).sum())
        assert n_gpu == _nucleus_size(p.numpy().astype(np.float32), 0.8)


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_runs_and_stays_close(llm_cuda, tiny_models, case, dtype):
    half = copy.deepcopy(llm_cuda).to(dtype)
    stage = CudaGraphLLM(half, tiny_models.config, slots=1, max_len=256, progress=False)
    toks = _run(stage, _inputs(case), case, 0, 120, True)
    assert len(toks) == 120 and 0 <= min(toks) and max(toks) < tiny_models.config.llm.speech_token_size
    with torch.inference_mode():
        x = half.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
    rows = teacher_forced_logp(stage, x, case["forced_tokens"].tolist()).cpu()
    assert rows.dtype == torch.float32
    ref = torch.cat([case["logp_first"][None], case["forced_logp"]])
    # logits stay fp32; the error is the half-precision network's (tiny random model, per-element log-probs)
    assert (rows - ref).abs().max().item() <= (0.15 if dtype == torch.bfloat16 else 0.03)
    assert stage.slots_in_use == 0


def _random_full_size_lm(dtype: torch.dtype) -> Qwen2LM:
    """CosyVoice2-0.5B shapes with seeded random weights (:func:`helpers.random_full_size_lm`)."""
    from helpers import random_full_size_lm

    return random_full_size_lm(dtype)


@_gpu
def test_gpu_full_size_tokens_equal_eager():
    cfg = full_config()
    text = torch.arange(100, 130, dtype=torch.int32)[None]
    inputs = ModelInputs(text_segments=[text], prompt_text=torch.arange(200, 220)[None],
                         llm_prompt_speech_token=torch.arange(75)[None] * 37 % 6561)
    lm = _random_full_size_lm(torch.float32)
    stage = CudaGraphLLM(lm, cfg, slots=2, max_len=256, kv_buckets=(160,), progress=False)
    for seed in (0, 1):
        g1, g2 = (torch.Generator("cuda").manual_seed(seed) for _ in range(2))
        got = generate_alone(stage, inputs, text, g1, 60, True)
        assert got == generate_alone(EagerLLM(lm, cfg), inputs, text, g2, 60, True)
    del stage
    bf16 = CudaGraphLLM(lm.to(torch.bfloat16), cfg, slots=1, max_len=256, progress=False)
    toks = list(islice(iter_alone(bf16, inputs, text, torch.Generator("cuda").manual_seed(0), 60, True), 60))
    assert len(toks) == 60 and max(toks) < cfg.llm.speech_token_size
