"""LLM slots sized from free GPU memory when ``EngineConfig.llm_slots`` is None, and handed to the cudagraph LLM."""

from __future__ import annotations

import types

import pytest
import torch

from cosyvoice_fast.config.model import QwenConfig
from cosyvoice_fast.config.engine import EngineConfig, kv_bytes_per_token, llm_slots_for_memory, resolve_llm_slots
from cosyvoice_fast.config.yamlfile import ConfigError

QWEN_05B = QwenConfig()  # the defaults are Qwen2-0.5B's (CosyVoice-BlankEN): 24 layers, 2 KV heads of 64
MiB, GiB = 2**20, 2**30


def test_bytes_per_kv_token_from_the_model_config():
    # 24 layers x (K, V) x 2 kv heads x 64 dims x 2 bytes = 12 KiB per position in bf16
    assert kv_bytes_per_token(QWEN_05B, torch.bfloat16) == 24 * 2 * 2 * 64 * 2 == 12288
    assert kv_bytes_per_token(QWEN_05B, "fp16") == 12288
    assert kv_bytes_per_token(QWEN_05B, torch.float32) == 24576
    tiny = QwenConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert kv_bytes_per_token(tiny, "fp32") == 2 * 2 * 2 * 16 * 4
    with pytest.raises(ConfigError, match="unknown dtype"):
        kv_bytes_per_token(QWEN_05B, torch.int8)


def test_64_slots_of_2048_positions_take_1_5_gib_in_bf16():
    assert 64 * 2048 * kv_bytes_per_token(QWEN_05B, "bf16") == 1.5 * GiB


@pytest.mark.parametrize("free, fraction, expected", [
    (70 * GiB, 0.25, 64),  # an H100 after loading: capped at max_streams
    (2 * GiB, 0.5, 42),  # 1 GiB / 24 MiB per slot = 42.67
    (4 * GiB, 0.25, 42),
    (100 * MiB, 0.25, 1),  # a quarter holds no slot, but one fits in what is free: serve one at a time
    (24 * MiB, 0.25, 1),  # exactly one slot of 24 MiB
])
def test_slots_from_free_memory(free, fraction, expected):
    assert llm_slots_for_memory(64, 2048, 12288, free, fraction) == expected


def test_no_slot_fits_names_the_flag_to_turn():
    with pytest.raises(ConfigError, match=r"max_context: one LLM slot of 2048 positions needs 24 MiB .* only 10 MiB "
                                          r"of GPU memory is free; lower --max-context"):
        llm_slots_for_memory(64, 2048, 12288, 10 * MiB, 0.25)


def test_resolve_explicit_cpu_and_gpu(monkeypatch):
    assert resolve_llm_slots(EngineConfig(llm_slots=5), QWEN_05B, torch.bfloat16, torch.device("cuda")) == 5
    assert resolve_llm_slots(EngineConfig(max_streams=12), QWEN_05B, torch.float32, torch.device("cpu")) == 12
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (seen.append(dev), (3 * GiB, 80 * GiB))[1])
    cfg = EngineConfig(max_streams=64, max_context=1024, llm_memory_fraction=0.5)
    # 1.5 GiB / (1024 x 12 KiB = 12 MiB) = 128 -> capped at 64; with fewer streams allowed, more is the cap
    assert resolve_llm_slots(cfg, QWEN_05B, torch.bfloat16, torch.device("cuda:0")) == 64
    cfg = EngineConfig(max_streams=200, max_context=1024, llm_memory_fraction=0.5)
    assert resolve_llm_slots(cfg, QWEN_05B, torch.bfloat16, torch.device("cuda:0")) == 128
    assert seen == [torch.device("cuda:0")] * 2


def test_stage_build_hands_slots_and_max_context_to_the_cudagraph_llm(monkeypatch):
    import cosyvoice_fast.llm.graph as cg
    from cosyvoice_fast.engine import stages as backends

    got = {}

    class Recorder:
        def __init__(self, llm, config, **kw):
            got.update(kw)

    monkeypatch.setattr(cg, "CudaGraphLLM", Recorder)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2 * GiB, 80 * GiB))
    models = types.SimpleNamespace(config=types.SimpleNamespace(llm=types.SimpleNamespace(qwen=QWEN_05B)),
                                   device=torch.device("cuda"))
    cfg = EngineConfig(max_streams=64, max_context=2048, llm_memory_fraction=0.5)
    backends._build_llm(models, "cudagraph", torch.nn.Linear(1, 1), torch.bfloat16, cfg)
    assert got == {"slots": 42, "max_len": 2048, "defer_capture": False}  # the default: every graph before ready
    backends._build_llm(models, "cudagraph", torch.nn.Linear(1, 1), torch.bfloat16,
                        EngineConfig(llm_slots=3, max_context=512, background_capture=True))
    assert got == {"slots": 3, "max_len": 512, "defer_capture": True}  # the rest after ready
    backends._build_llm(models, "cudagraph", torch.nn.Linear(1, 1), torch.bfloat16,
                        EngineConfig(llm_slots=3, max_context=512, background_capture=False))
    assert got == {"slots": 3, "max_len": 512, "defer_capture": False}
