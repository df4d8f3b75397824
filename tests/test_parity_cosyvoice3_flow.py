"""CosyVoice3's flow (``CausalMaskedDiffWithDiT``) against the recorded fixture: DiT estimator, pre-look-ahead,
CFM and the streamed chunk calls, fp32 on CPU within the fixture README's 1e-4.

Every size, id and call comes from the fixture files (``cosyvoice3.yaml``, ``case_flow*.pt``), so a hold-out set
with other sizes and seeds runs through the same tests.
"""

from __future__ import annotations

import pytest
import torch

from cosyvoice_fast.config.dit import DiTFlowConfig, dit_flow_config_from_doc
from cosyvoice_fast.config.yamlfile import ConfigError, read_hyperpyyaml
from cosyvoice_fast.flow.model.dit import chunk_attention_mask
from cosyvoice_fast.flow.model.dit_flow import DiTFlow, load_dit_flow

TOL = 1e-4


@pytest.fixture(scope="module")
def cv3_cfg(fixture3_dir) -> DiTFlowConfig:
    return dit_flow_config_from_doc(read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml"), "cosyvoice3.yaml")


@pytest.fixture(scope="module")
def cv3_flow(fixture3_dir, cv3_cfg) -> DiTFlow:
    return load_dit_flow(cv3_cfg, torch.load(fixture3_dir / "flow.pt", weights_only=True))


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def test_cosyvoice3_flow_config_matches_weights(fixture3_dir, cv3_cfg):
    sd = torch.load(fixture3_dir / "flow.pt", weights_only=True)
    dit = cv3_cfg.dit
    assert sd["input_embedding.weight"].shape == (cv3_cfg.vocab_size, cv3_cfg.input_size)
    assert sd["pre_lookahead_layer.conv1.weight"].shape == (cv3_cfg.pre_lookahead_channels, cv3_cfg.input_size,
                                                            cv3_cfg.pre_lookahead_len + 1)
    assert sd["decoder.estimator.input_embed.proj.weight"].shape == (dit.dim, dit.in_features)
    assert sd["decoder.estimator.rotary_embed.inv_freq"].shape == (dit.dim_head // 2,)
    n_blocks = len({k.split(".")[3] for k in sd if k.startswith("decoder.estimator.transformer_blocks.")})
    assert n_blocks == dit.depth
    assert dit.static_chunk_size == 50 and cv3_cfg.token_mel_ratio == 2 and cv3_cfg.cfm.inference_cfg_rate == 0.7


def test_cosyvoice3_flow_config_errors_name_file_and_field(fixture3_dir):
    doc = read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml")
    del doc["flow"]["decoder"]["estimator"]["depth"]
    with pytest.raises(ConfigError, match=r"^cosyvoice3\.yaml: missing field flow\.decoder\.estimator\.depth"):
        dit_flow_config_from_doc(doc, "cosyvoice3.yaml")
    with pytest.raises(ConfigError, match=r"^x\.yaml: missing field flow"):
        dit_flow_config_from_doc({}, "x.yaml")


def test_cosyvoice3_flow_state_dict_keys_are_flow_pt(fixture3_dir, cv3_cfg):
    sd = torch.load(fixture3_dir / "flow.pt", weights_only=True)
    assert set(DiTFlow(cv3_cfg).state_dict()) == set(sd)
    bad = dict(sd)
    bad.pop("decoder.estimator.proj_out.bias")
    with pytest.raises(ValueError, match="flow.pt does not match"):
        load_dit_flow(cv3_cfg, bad)


def test_cosyvoice3_chunk_mask_rule():
    m = chunk_attention_mask(7, 7, 3)[0, 0]
    for i in range(7):
        assert m[i].tolist() == [j < (i // 3 + 1) * 3 for j in range(7)]
    tail = chunk_attention_mask(2, 7, 3, query_start=5)[0, 0]
    assert torch.equal(tail, m[5:])


@pytest.mark.parametrize("streaming,key", [(False, "estimator_output"), (True, "estimator_output_streaming")])
def test_cosyvoice3_dit_estimator(cv3_flow, load_case3, streaming, key):
    case = load_case3("case_flow")
    e = case["estimator_inputs"]
    with torch.inference_mode():
        out = cv3_flow.decoder.estimator(e["x"], e["mask"], e["mu"], e["t"], e["spks"], e["cond"], streaming)
    assert _maxabs(out, case[key]) <= TOL
    # the two modes really differ on this input (the test could not pass with the wrong mask)
    assert _maxabs(case["estimator_output"], case["estimator_output_streaming"]) > 100 * TOL


def test_cosyvoice3_flow_encode_and_cfm(cv3_flow, load_case3):
    case = load_case3("case_flow")
    tok, ptok, pfeat, emb = case["token"], case["prompt_token"], case["prompt_feat"], case["embedding"]
    with torch.inference_mode():
        spks = cv3_flow.speaker_condition(emb)
        rows = cv3_flow.embed_tokens(torch.cat((ptok, tok), 1), torch.tensor([ptok.shape[1] + tok.shape[1]]))
        pre = cv3_flow.lookahead(rows, finalize=True)
        enc = cv3_flow.encode(tok, torch.tensor([tok.shape[1]]), ptok, torch.tensor([ptok.shape[1]]), emb)
        n = enc.mu.shape[2]
        cond = torch.zeros(1, enc.mu.shape[1], n)
        cond[:, :, :pfeat.shape[1]] = pfeat.transpose(1, 2)
        cfm = cv3_flow.decoder(enc.mu, torch.ones(1, 1, n), enc.spks, cond, streaming=bool(case["streaming"]))
    assert _maxabs(spks, case["spks"]) <= TOL
    assert _maxabs(pre, case["pre_lookahead_out"]) <= TOL
    assert n == case["cfm_out"].shape[2] == cv3_flow.cfg.token_mel_ratio * (ptok.shape[1] + tok.shape[1])
    # the estimator's first call sees exactly these conditional rows
    e = case["estimator_inputs"]
    assert _maxabs(enc.mu[0], e["mu"][0]) <= TOL and _maxabs(cond[0], e["cond"][0]) <= TOL
    assert _maxabs(cfm, case["cfm_out"]) <= TOL


def test_cosyvoice3_flow_inference_mel(cv3_flow, load_case3):
    case = load_case3("case_flow")
    mel = cv3_flow.inference(case["token"], case["prompt_token"], case["prompt_feat"], case["embedding"],
                             streaming=bool(case["streaming"]), finalize=bool(case["finalize"]))
    assert _maxabs(mel, case["mel"]) <= TOL


def test_cosyvoice3_flow_stream_calls(cv3_flow, load_case3):
    case = load_case3("case_flow_stream")
    calls = case["calls"]
    assert calls[-1]["finalize"] and not calls[-1]["streaming"]
    for call in calls:
        n = int(call["n_tokens"])
        mel = cv3_flow.inference(case["token"][:, :n], case["prompt_token"], case["prompt_feat"],
                                 case["embedding"], streaming=bool(call["streaming"]),
                                 finalize=bool(call["finalize"]))
        assert _maxabs(mel, call["mel"]) <= TOL, f"call with {n} tokens"
    full = cv3_flow.inference(case["token"], case["prompt_token"], case["prompt_feat"], case["embedding"],
                              streaming=False, finalize=True)
    assert _maxabs(full, case["nonstream_mel"]) <= TOL


def test_cosyvoice3_flow_refuses_batches_and_short_lookahead(cv3_flow, load_case3):
    case = load_case3("case_flow")
    with pytest.raises(ValueError, match="one utterance at a time"):
        cv3_flow.inference(case["token"].repeat(2, 1), case["prompt_token"], case["prompt_feat"], case["embedding"])
    rows = torch.zeros(1, 2, cv3_flow.cfg.input_size)
    with pytest.raises(ValueError, match="cannot hold 3 look-ahead tokens"):
        cv3_flow.lookahead(rows, finalize=False, n_lookahead=3)
