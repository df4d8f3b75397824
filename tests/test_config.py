"""Reading cosyvoice2.yaml without executing it, and the errors a wrong directory gives."""

from __future__ import annotations

import shutil

import pytest

from cosyvoice_fast.config.yamlfile import ConfigError, read_hyperpyyaml
from cosyvoice_fast.config.model import ModelConfig, tiny_config


def test_fixture_yaml_reads_to_tiny_sizes(fixture_dir):
    cfg = ModelConfig.from_files(fixture_dir / "cosyvoice2.yaml", fixture_dir / "CosyVoice-BlankEN" / "config.json")
    assert cfg == tiny_config()
    assert cfg.flow.decoder.static_chunk_size == 50  # "!ref <chunk_size> * <token_mel_ratio>" evaluated
    assert cfg.llm.qwen.head_dim == 16


def test_tags_are_never_executed(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("x: !apply:os.system ['touch " + str(tmp_path / "pwned") + "']\n"
                 "y: !new:subprocess.Popen\n    args: ['true']\n")
    doc = read_hyperpyyaml(p)
    assert not (tmp_path / "pwned").exists()
    assert doc["y"].tag == "new:subprocess.Popen"


def test_ref_arithmetic_refuses_code(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("a: 2\nb: !ref <a> * __import__('os').getpid()\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        read_hyperpyyaml(p)


def test_a_yaml_mixing_two_families_is_refused_with_a_hint(fixture_dir, tmp_path):
    text = (fixture_dir / "cosyvoice2.yaml").read_text()
    p = tmp_path / "cosyvoice2.yaml"
    p.write_text(text.replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.CosyVoice3LM"))
    with pytest.raises(ConfigError, match="llm is CosyVoice3LM and flow is CausalMaskedDiffWithXvec, which is no "
                                          "model family cosyvoice_fast runs .*not CosyVoice1, and not a mix"):
        ModelConfig.from_files(p, fixture_dir / "CosyVoice-BlankEN" / "config.json")


def test_missing_field_is_named(fixture_dir, tmp_path):
    text = (fixture_dir / "cosyvoice2.yaml").read_text()
    p = tmp_path / "cosyvoice2.yaml"
    p.write_text(text.replace("    pre_lookahead_len: 3\n", ""))
    with pytest.raises(ConfigError, match="flow.pre_lookahead_len"):
        ModelConfig.from_files(p, fixture_dir / "CosyVoice-BlankEN" / "config.json")


def test_broken_json_is_named(fixture_dir, tmp_path):
    d = tmp_path / "CosyVoice-BlankEN"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_files(fixture_dir / "cosyvoice2.yaml", d / "config.json")
