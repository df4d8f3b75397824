"""Parity of CosyVoice3's causal HiFT (f0 predictor in float64, NSF source with the fixed noise tables, the causal
generator) with upstream's recorded outputs (case_hift), one shot and as upstream's streamed calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cosyvoice_fast.config.causal_hift import CausalHiFTConfig, causal_hift_config_from_doc
from cosyvoice_fast.config.yamlfile import ConfigError, read_hyperpyyaml
from cosyvoice_fast.vocoder.model.causal_hift import CausalHiFTGenerator
from cosyvoice_fast.vocoder.model.causal_noise import NoiseTable, replay_generator

TOL = 1e-4  # the fixture's waveform / f0 tolerance (fp32 CPU)


@pytest.fixture(scope="module")
def case(load_case3) -> dict:
    return load_case3("case_hift")


@pytest.fixture(scope="module")
def state_dict(fixture3_dir) -> dict:
    return torch.load(fixture3_dir / "hift.pt", weights_only=True)


@pytest.fixture(scope="module")
def cfg(fixture3_dir) -> CausalHiFTConfig:
    return causal_hift_config_from_doc(read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml"), "cosyvoice3.yaml")


@pytest.fixture(scope="module")
def hift(cfg, state_dict) -> CausalHiFTGenerator:
    return CausalHiFTGenerator(cfg).load_checkpoint(state_dict).eval()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------- config, checkpoint

def test_cosyvoice3_config_matches_the_checkpoint_shapes(cfg, state_dict):
    assert state_dict["conv_pre.parametrizations.weight.original1"].shape == (
        cfg.base_channels, cfg.in_channels, cfg.conv_pre_look_right + 1)
    assert state_dict["f0_predictor.condnet.0.parametrizations.weight.original1"].shape == (
        cfg.f0_cond_channels, cfg.f0_in_channels, 4)
    assert cfg.upsample_factor == 480 and cfg.n_harmonics == 9


def test_cosyvoice3_config_errors_name_file_and_field(fixture3_dir):
    doc = read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml")
    broken = dict(doc)
    broken["hift"] = type(doc["hift"])(doc["hift"].tag, {k: v for k, v in doc["hift"].items() if k != "nsf_alpha"})
    with pytest.raises(ConfigError, match=r"^cosyvoice3.yaml: missing field hift.nsf_alpha; is this a CosyVoice3"):
        causal_hift_config_from_doc(broken, "cosyvoice3.yaml")
    wrong = dict(doc)
    wrong["hift"] = type(doc["hift"])("new:cosyvoice.hifigan.generator.HiFTGenerator", dict(doc["hift"]))
    with pytest.raises(ConfigError, match="hift is HiFTGenerator, not CausalHiFTGenerator"):
        causal_hift_config_from_doc(wrong, "x.yaml")


def test_cosyvoice3_checkpoint_loads_strictly_in_both_weight_norm_styles(cfg, state_dict, hift, case):
    legacy = {k.replace("parametrizations.weight.original0", "weight_g")
              .replace("parametrizations.weight.original1", "weight_v"): v for k, v in state_dict.items()}
    assert any(k.endswith("weight_g") for k in legacy)
    other = CausalHiFTGenerator(cfg, hift.noise).load_checkpoint(legacy).eval()
    mel = case["mel"][:, :, :20]
    with torch.inference_mode():
        assert torch.equal(other.inference(mel)[0], hift.inference(mel)[0])
    with pytest.raises(RuntimeError, match="Unexpected key"):
        CausalHiFTGenerator(cfg, hift.noise).load_checkpoint({**state_dict, "extra.weight": torch.zeros(1)})


# --------------------------------------------------------------------------------------------- noise tables

def test_cosyvoice3_noise_replay_from_seed_reaches_the_recorded_generator_state(cfg, case):
    assert torch.equal(replay_generator(cfg).get_state(), case["rng_state_before_hift"])


@pytest.mark.parametrize("route", ["replay", "recorded_state"])
def test_cosyvoice3_noise_tables_equal_upstream(cfg, case, route):
    table = NoiseTable(cfg, None if route == "replay" else case["rng_state_before_hift"])
    head = case["sine_waves_head"]
    assert torch.equal(table.rand_ini, case["rand_ini"])
    assert torch.equal(table.rows(0, head.shape[1]), head)
    assert torch.equal(table.rows(7, head.shape[1]), head[:, 7:])


def test_cosyvoice3_noise_table_drawn_in_pieces_equals_one_draw(cfg, case):
    """The table is drawn lazily; torch's CPU uniform kernel is serial, so pieces equal one draw."""
    table = NoiseTable(cfg, case["rng_state_before_hift"])
    first = table.rows(0, 960).clone()
    n = case["n_samples_used"] + 17 * 480  # more than the first piece (48000 rows) holds
    grown = table.rows(0, n)
    assert table.drawn >= n and table.drawn < 2 * n + 48000
    g = torch.Generator()
    g.set_state(case["rng_state_before_hift"])
    torch.rand(1, cfg.n_harmonics, generator=g)
    whole = torch.rand(1, n, cfg.n_harmonics, generator=g)
    assert torch.equal(grown, whole) and torch.equal(first, whole[:, :960])


def test_cosyvoice3_noise_table_refuses_audio_longer_than_it(cfg):
    table = NoiseTable(dataclasses.replace(cfg, noise_table_len=4800))
    assert table.rows(0, 4800).shape == (1, 4800, 9)
    with pytest.raises(ValueError, match=r"^4801 samples of audio exceed CosyVoice3's noise table \(4800 samples"):
        table.rows(0, 4801)


# --------------------------------------------------------------------------------------------- one shot

def test_cosyvoice3_f0_float64(hift, case):
    with torch.inference_mode():
        f0 = hift.f0(case["mel"])
    assert f0.dtype == torch.float64 and f0.shape == case["f0_float64"].shape
    assert _err(f0, case["f0_float64"]) <= 1e-9
    assert _err(f0.float(), case["f0"]) <= TOL
    assert 0.2 < float((case["f0"] > 10).float().mean()) < 0.9  # both sides of the voiced threshold are exercised


def test_cosyvoice3_source(hift, case):
    with torch.inference_mode():
        source, _ = hift.source(case["f0"])
    assert _err(source, case["source"]) <= 1e-6


def test_cosyvoice3_wav_one_shot(hift, case):
    with torch.inference_mode():
        wav, source = hift.inference(case["mel"], finalize=True)
    assert wav.shape == (1, case["mel"].shape[2] * 480)
    assert _err(source, case["source"]) <= 1e-6
    assert _err(wav, case["wav"]) <= TOL


def test_cosyvoice3_remove_weight_norm_keeps_the_output(hift, case):
    plain = hift.remove_weight_norm()
    assert plain.noise is hift.noise
    assert "f0_predictor.condnet.0.parametrizations.weight.original0" in plain.state_dict()
    assert "conv_post.weight" in plain.state_dict()
    with torch.inference_mode():
        assert _err(plain.inference(case["mel"])[0], case["wav"]) <= TOL


# --------------------------------------------------------------------------------------------- upstream's streaming

def test_cosyvoice3_upstream_streamed_calls(hift, case):
    """Each of token2wav's calls re-run on the whole mel so far: lengths, f0 and the emitted samples."""
    mel = case["mel"]
    for call in case["stream"]:
        n, fin = call["n_mel"], call["finalize"]
        with torch.inference_mode():
            wav, _ = hift.inference(mel[:, :, :n], finalize=fin)
            f0 = hift.f0(mel[:, :, :n], finalize=fin).float()
        assert wav.shape[1] == call["n_out"] == (n * 480 if fin else (n - 8) * 480)
        assert f0.shape == call["f0"].shape and _err(f0, call["f0"]) <= TOL
        emitted = wav[:, call["speech_offset"]:]
        ref = call["emitted"] if not fin else case["wav"][:, call["speech_offset"]:]
        assert _err(emitted, ref) <= TOL
