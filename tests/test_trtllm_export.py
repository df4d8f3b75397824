"""TensorRT-LLM checkpoint export: names, shapes, a safetensors round trip that reproduces the LM's log-probs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from cosyvoice_fast.llm.trtllm_export import export_qwen2_checkpoint
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder


@pytest.fixture(scope="module")
def tiny_llm(fixture_dir):
    from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
    from cosyvoice_fast.modeldir.files import load_state_dict_file, load_strict, read_config, validate_model_dir

    config = read_config(validate_model_dir(fixture_dir))
    llm = Qwen2LM(config.llm)
    load_strict(llm, load_state_dict_file(fixture_dir / "llm.pt"), "llm.pt", "")
    return llm.eval(), config


@pytest.fixture(scope="module")
def exported(tiny_llm, tmp_path_factory):
    llm, config = tiny_llm
    out = tmp_path_factory.mktemp("trtllm_ckpt")
    vocab = export_qwen2_checkpoint(llm, config.llm, out, dtype=torch.float32)
    return out, vocab


def test_checkpoint_layout(exported, tiny_llm):
    out, vocab = exported
    cfg = json.loads((out / "config.json").read_text())
    q = tiny_llm[1].llm.qwen
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["vocab_size"] == vocab.size == q.vocab_size + 6564 + 2
    assert cfg["eos_token_id"] == q.vocab_size + 6561
    sd = load_file(str(out / "model.safetensors"))
    assert sd["model.embed_tokens.weight"].shape == (vocab.size, q.hidden_size)
    assert sd["lm_head.weight"].shape == (vocab.size, q.hidden_size)
    n_layer_keys = sum(k.startswith("model.layers.0.") for k in sd)
    assert n_layer_keys == 12  # q/k/v weight+bias, o_proj, gate/up/down, 2 norms
    assert not any(k.startswith("llm.") for k in sd)
    assert torch.count_nonzero(sd["lm_head.weight"][: q.vocab_size]) == 0


def test_roundtrip_reproduces_first_logprobs(exported, tiny_llm, load_case):
    """Ids through the exported tables + Qwen2 + head slice + side bias == the recorded upstream log-probs."""
    out, vocab = exported
    case = load_case("case_llm")
    sd = load_file(str(out / "model.safetensors"))
    head = load_file(str(out / "speech_head.safetensors"))
    qcfg = replace(tiny_llm[1].llm.qwen, vocab_size=vocab.size, tie_word_embeddings=False)
    dec = Qwen2Decoder(qcfg)
    dec.load_state_dict({k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}, strict=True)
    ids = vocab.lm_input_ids(case["text"], case["prompt_text"], case["prompt_speech_token"])
    assert len(ids) == case["lm_input"].shape[1]
    with torch.no_grad():
        emb = dec.embed_tokens(torch.tensor([ids]))
        torch.testing.assert_close(emb, case["lm_input"], atol=0, rtol=0)
        hidden = dec(emb, torch.arange(len(ids)))[:, -1]
        logits = hidden @ sd["lm_head.weight"].T
        speech = logits[0, vocab.speech_offset: vocab.speech_offset + vocab.speech_rows] + head["bias"]
        logp = speech.log_softmax(-1)
    assert (logp - case["logp_first"]).abs().max().item() <= 1e-4
