"""Parity of the flow model (encoder + CFM) with the recorded upstream outputs, and encoder behaviour checks."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.flow.model.encoder import UpsampleConformerEncoder
from cosyvoice_fast.flow.model.encoder_layers import relative_position_table, shift_relative_scores

TOL = 1e-4


def _len(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([x.shape[1]], dtype=torch.int32)


@pytest.fixture(scope="module")
def config(fixture_dir) -> ModelConfig:
    return ModelConfig.from_files(fixture_dir / "cosyvoice2.yaml", fixture_dir / "CosyVoice-BlankEN" / "config.json")


@pytest.fixture(scope="module")
def encoder(fixture_dir, config) -> UpsampleConformerEncoder:
    """The encoder alone, strictly loaded from the ``encoder.*`` part of flow.pt."""
    sd = torch.load(fixture_dir / "flow.pt", weights_only=True)
    enc = UpsampleConformerEncoder(config.flow.encoder)
    enc.load_state_dict({k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.")}, strict=True)
    return enc.eval()


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


def test_encoder_has_no_extra_state(encoder, fixture_dir):
    """The positional table is computed, not stored: the state dict is exactly the checkpoint's."""
    sd = torch.load(fixture_dir / "flow.pt", weights_only=True)
    ours = set(encoder.state_dict())
    theirs = {k[len("encoder."):] for k in sd if k.startswith("encoder.")}
    assert ours == theirs


def test_relative_shift_matches_gather():
    """out[i, j] must be the score for distance (n_k - n_q + i) - j, for square and rectangular grids."""
    for n_q, n_k in ((1, 1), (1, 5), (4, 4), (3, 7)):
        width = n_k + n_q - 1
        raw = torch.randn(2, 3, n_q, width)
        i = torch.arange(n_q).unsqueeze(1)
        j = torch.arange(n_k).unsqueeze(0)
        idx = (n_q - 1 - i + j).expand(2, 3, n_q, n_k)
        expected = torch.gather(raw, 3, idx)
        assert torch.equal(shift_relative_scores(raw, n_k), expected)
    table = relative_position_table(3, 3, 8)
    assert table.shape == (1, 5, 8)
    assert torch.equal(table[0, 2], torch.tensor([0.0, 1.0] * 4))  # distance 0 in the middle
    assert torch.allclose(table[0, 0, 0::2], -table[0, 4, 0::2])  # sin is odd in the distance


def test_mu_parity(flow, load_case):
    case = load_case("case_flow")
    with torch.inference_mode():
        enc = flow.encode(case["token"], _len(case["token"]), case["prompt_token"], _len(case["prompt_token"]),
                          case["embedding"], streaming=bool(case["streaming"]), finalize=bool(case["finalize"]))
    assert enc.mu.shape == case["mu"].shape
    err = (enc.mu - case["mu"]).abs().max().item()
    assert err <= TOL, err
    spks_err = (enc.spks - case["estimator_inputs"]["spks"][:1]).abs().max().item()
    assert spks_err <= TOL, spks_err


def test_mel_parity(flow, load_case):
    case = load_case("case_flow")
    mel = flow.inference(case["token"], _len(case["token"]), case["prompt_token"], _len(case["prompt_token"]),
                         case["prompt_feat"], _len(case["prompt_feat"]), case["embedding"],
                         streaming=bool(case["streaming"]), finalize=bool(case["finalize"]))
    assert mel.shape == case["mel"].shape
    err = (mel - case["mel"]).abs().max().item()
    assert err <= TOL, err


def test_stream_calls_parity(flow, load_case):
    case = load_case("case_flow_stream")
    assert len(case["calls"]) >= 2
    errs = []
    for call in case["calls"]:
        tok = case["token"][:, : call["n_tokens"]]
        mel = flow.inference(tok, _len(tok), case["prompt_token"], _len(case["prompt_token"]), case["prompt_feat"],
                             _len(case["prompt_feat"]), case["embedding"], streaming=bool(call["streaming"]),
                             finalize=bool(call["finalize"]))
        assert mel.shape == call["mel"].shape, (call["n_tokens"], mel.shape, call["mel"].shape)
        errs.append((mel - call["mel"]).abs().max().item())
    assert max(errs) <= TOL, errs


def test_encoder_chunk_causality(encoder, config):
    """Streaming: frames of chunk c depend on tokens of chunks <= c plus exactly the pre-look-ahead reach."""
    ecfg = config.flow.encoder
    chunk, look, stride = ecfg.static_chunk_size, ecfg.pre_lookahead_len, ecfg.upsample_stride
    n = 2 * chunk + 10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, ecfg.input_size, generator=g)
    first = chunk * stride  # frames of chunk 0

    def run(inp: torch.Tensor, streaming: bool) -> torch.Tensor:
        with torch.inference_mode():
            return encoder(inp, torch.tensor([n]), streaming=streaming)[0]

    base = run(x, True)
    beyond = x.clone()
    beyond[:, chunk + look:] += torch.randn(1, n - chunk - look, ecfg.input_size, generator=g)
    out = run(beyond, True)
    assert torch.equal(out[:, :first], base[:, :first])
    assert (out[:, first:] - base[:, first:]).abs().max() > 1e-3

    within_reach = x.clone()
    within_reach[:, chunk + look - 1] += 1.0  # the last token the look-ahead conv of chunk 0 sees
    out = run(within_reach, True)
    assert (out[:, :first] - base[:, :first]).abs().max() > 1e-4

    full = run(beyond, False) - run(x, False)
    assert full[:, :first].abs().max() > 1e-3  # without the chunk mask the future leaks back


def test_lookahead_context_equals_streaming_prefix(encoder, config):
    """At a chunk boundary, encoding T tokens with look-ahead context == the first frames of encoding T+L."""
    ecfg = config.flow.encoder
    chunk, look, stride = ecfg.static_chunk_size, ecfg.pre_lookahead_len, ecfg.upsample_stride
    t = 2 * chunk
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, t + look, ecfg.input_size, generator=g)
    with torch.inference_mode():
        with_ctx, _ = encoder(x[:, :t], torch.tensor([t]), context=x[:, t:], streaming=True)
        whole, _ = encoder(x, torch.tensor([t + look]), streaming=True)
    assert with_ctx.shape[1] == t * stride
    assert (with_ctx - whole[:, : t * stride]).abs().max().item() <= 1e-5
