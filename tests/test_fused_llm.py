"""The ``fused`` LLM backend: registration and refusal on CPU; on a GPU, full-size parity with eager.

GPU tests are marked ``gpu`` (skipped without CUDA): ``python -m pytest -m gpu tests/test_fused_llm.py``.
Full size means CosyVoice2-0.5B shapes with seeded random weights (the real checkpoint is not on the GPU box).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.engine.stages import available_backends
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.model import full_config, tiny_config
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.frontend.request import ModelInputs

HAS_CUDA = torch.cuda.is_available()
_gpu = pytest.mark.gpu


def test_fused_is_an_llm_backend_name():
    assert BackendConfig(llm="fused").llm == "fused"


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_listed_unavailable_on_cpu_with_the_reason():
    info = {(b.stage, b.name): b for b in available_backends("cpu")}
    assert not info[("llm", "fused")].available and "CUDA" in info[("llm", "fused")].reason


def test_refuses_a_cpu_model_and_says_what_to_choose():
    from cosyvoice_fast.llm.fused import FusedLLM

    cfg = tiny_config()
    with pytest.raises(BackendUnavailable, match=r"needs a CUDA GPU \(this engine runs on cpu\); choose 'eager'"):
        FusedLLM(Qwen2LM(cfg.llm), cfg)


# ------------------------------------------------------------------------------------------ GPU


def _random_full_size_lm(dtype: torch.dtype) -> Qwen2LM:
    """CosyVoice2-0.5B shapes with seeded random weights (:func:`helpers.random_full_size_lm`)."""
    from helpers import random_full_size_lm

    return random_full_size_lm(dtype)


@pytest.fixture(scope="module")
def lm32() -> Qwen2LM:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return _random_full_size_lm(torch.float32)


def _step_inputs(rows: int, context: int, max_len: int, dtype: torch.dtype, cfg) -> tuple:  # noqa: ANN001
    """Seeded embeddings (rows, 1, H), per-row positions near ``context`` and a random-filled cache, built in
    fp32 on the CPU and rounded to ``dtype`` (so fp32 references can take the very same values)."""
    g = torch.Generator().manual_seed(rows)
    q = cfg.llm.qwen
    x = torch.randn(rows, 1, q.hidden_size, generator=g) * 0.05
    kv = torch.randn(2, q.num_hidden_layers, rows, q.num_key_value_heads, max_len, q.head_dim, generator=g)
    pos = (context - 1 - torch.randperm(min(rows * 4, context), generator=g)[:rows]).view(rows, 1)
    return x.to("cuda", dtype), kv.to("cuda", dtype), pos.cuda()


def _run(lm: Qwen2LM, fused: bool, x, kv, pos, kv_len: int) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
    from cosyvoice_fast.bench.profile_llm import step_over_cache

    h, cache = step_over_cache(lm, fused, x, kv, pos, kv_len)
    return h, cache.k + cache.v


@_gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 40])  # 1..16: small-row kernels; 40: looped
def test_gpu_full_size_fp32_step_equals_eager(lm32, rows):
    x, kv, pos = _step_inputs(rows, 300, 512, torch.float32, full_config())
    ref, ref_cache = _run(lm32, False, x, kv, pos, 512)
    got, got_cache = _run(lm32, True, x, kv, pos, 512)
    assert (got - ref).abs().max().item() <= 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(got_cache, ref_cache)) <= 1e-4
    with torch.inference_mode():  # the speech head (std 0.1 over 896 inputs) scales hidden errors up ~3x
        assert (lm32.log_probs(got[:, -1]) - lm32.log_probs(ref[:, -1])).abs().max().item() <= 3e-4


@_gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 40])  # 1..16: small-row kernels; 40: looped
def test_gpu_full_size_bf16_step_is_no_worse_than_eager_bf16(lm32, rows):
    """Against the fp32 step on the same (bf16-rounded) inputs, the fused bf16 step errs no more than the eager
    bf16 step (it keeps the residual stream in fp32, so usually less)."""
    lm16 = copy.deepcopy(lm32).to(torch.bfloat16)
    x, kv, pos = _step_inputs(rows, 300, 512, torch.bfloat16, full_config())
    ref, _ = _run(lm32, False, x.float(), kv.float(), pos, 512)
    eager, _ = _run(lm16, False, x, kv, pos, 512)
    fused, _ = _run(lm16, True, x, kv, pos, 512)
    e_eager = (eager.float() - ref).abs().max().item()
    e_fused = (fused.float() - ref).abs().max().item()
    assert e_fused <= 1.25 * e_eager, (e_fused, e_eager)


@_gpu
def test_gpu_fused_backend_tokens_equal_eager_fp32_alone_and_batched(lm32):
    from cosyvoice_fast.bench.llm_tools import generate_alone
    from cosyvoice_fast.llm.eager import EagerLLM
    from cosyvoice_fast.llm.fused import FusedLLM

    cfg = full_config()
    text = torch.arange(100, 130, dtype=torch.int32)[None]
    inputs = ModelInputs(text_segments=[text], prompt_text=torch.arange(200, 220)[None],
                         llm_prompt_speech_token=torch.arange(75)[None] * 37 % 6561)
    stage = FusedLLM(lm32, cfg, slots=2, max_len=256, kv_buckets=(160,), progress=False)

    def run(st, seed: int) -> list[int]:  # noqa: ANN001
        return generate_alone(st, inputs, text, torch.Generator("cuda").manual_seed(seed), 60, True)

    alone = {seed: run(stage, seed) for seed in (0, 1)}
    for seed in (0, 1):
        assert alone[seed] == run(EagerLLM(lm32, cfg), seed)
    states = [stage.new_state(inputs, text, torch.Generator("cuda").manual_seed(s), 60, True) for s in (0, 1)]
    together: list[list[int]] = [[], []]
    call = stage.prefill
    while not all(st.done for st in states):  # both requests step in the same batched graph replays
        live = [i for i, st in enumerate(states) if not st.done]
        for i, r in zip(live, call([states[i] for i in live])):
            assert not isinstance(r, BaseException), r
            if r is not None:
                together[i].append(r)
        call = stage.decode
    assert together == [alone[0], alone[1]]
    assert stage.batched_rows > stage.batched_steps  # some steps really carried two rows
    assert stage.slots_in_use == 0
