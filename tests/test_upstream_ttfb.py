"""The CPU-checkable parts of ``benchmarks/upstream_ttfb.py`` (upstream's own model timed on our inputs): the yaml it
hands upstream keeps exactly the model entries, and the synthetic directories carry complete model entries."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.upstream_ttfb import main, model_yaml  # noqa: E402
from cosyvoice_fast.config.model import ModelConfig, full_config, tiny_config  # noqa: E402
from cosyvoice_fast.modeldir.synthetic import _qwen_json, _yaml_text  # noqa: E402


def _top_keys(text: str) -> list[str]:
    return [ln.split(":")[0] for ln in text.splitlines() if ln and (ln[0].isalpha() or ln[0] == "_") and ":" in ln]


def test_model_yaml_keeps_the_settings_and_the_three_networks_only(fixture_dir):
    full = (Path(fixture_dir) / "cosyvoice2.yaml").read_text()
    kept = model_yaml(full)
    keys = _top_keys(kept)
    assert {"llm", "flow", "hift", "sample_rate", "qwen_pretrain_path", "chunk_size"} <= set(keys)
    dropped = set(_top_keys(full)) - set(keys)
    assert {"hifigan", "mel_spec_transform1", "get_tokenizer", "feat_extractor"} <= dropped
    assert not any(k.startswith("__") for k in keys)  # the seed-setting !apply entries stay out
    assert "]" not in [ln.strip() for ln in kept.splitlines() if not ln.startswith(" ")]  # no list tail cut loose
    assert "cosyvoice.hifigan.generator.HiFTGenerator" in kept and "discriminator" not in kept


@pytest.mark.parametrize("config", [tiny_config, full_config])
def test_synthetic_yaml_names_every_constructor_entry_upstream_needs(config):
    text = _yaml_text(config())
    for entry in ("qwen_pretrain_path: ''", "llm: !new:cosyvoice.llm.llm.Qwen2Encoder",
                  "pretrain_path: !ref <qwen_pretrain_path>", "input_layer: 'linear'",
                  "pos_enc_layer_type: 'rel_pos_espnet'", "selfattention_layer_type: 'rel_selfattn'",
                  "normalize_before: True", "use_cnn_module: False", "solver: 'euler'", "n_spks: 1"):
        assert entry in text, entry
    assert model_yaml(text).count("!new:") == text.count("!new:")  # every entry is a model entry


@pytest.mark.parametrize("config", [tiny_config, full_config])
def test_the_completed_synthetic_yaml_reads_back_as_the_same_config(config, tmp_path):
    c = config()
    (tmp_path / "cosyvoice2.yaml").write_text(_yaml_text(c))
    (tmp_path / "config.json").write_text(json.dumps(_qwen_json(c)))
    assert ModelConfig.from_files(tmp_path / "cosyvoice2.yaml", tmp_path / "config.json") == c


def test_a_folder_without_upstream_packages_is_refused_with_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match=r"expected cosyvoice/ and matcha/ in it"):
        main(["--upstream-dir", str(tmp_path)])
