"""Model hyperparameters, read from the model directory as inert data.

The official model directory describes itself in ``cosyvoice2.yaml`` (or ``cosyvoice3.yaml``), a hyperpyyaml
file whose tags (``!new:``, ``!name:``, ``!apply:``, ``!ref``) would import and instantiate classes if executed.
We never execute it: a restricted YAML loader turns every tag into inert data, ``!ref <key>`` references are resolved
against the document, and the numbers are copied into the frozen dataclasses below.  The Qwen2 sizes come
from ``CosyVoice-BlankEN/config.json``.

Everything that can be wrong raises ``ConfigError`` (a ``ValueError``) naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cosyvoice_fast.config.causal_hift import causal_hift_config_from_doc
from cosyvoice_fast.config.cosyvoice2 import (  # noqa: F401 - re-exported: their home before CosyVoice3
    CFMConfig, DecoderConfig, EncoderConfig, FlowConfig, HiFTConfig, flow_config_from_doc, hift_config_from_doc,
)
from cosyvoice_fast.config.dit import dit_flow_config_from_doc
from cosyvoice_fast.config.llm import (  # noqa: F401 - re-exported: the LM's config lives in config.llm
    CV3_EXTRA_ROWS, CV3_MAX_SILENT_RUN, CV3_SILENT_TOKENS, LLM_FAMILIES, REAL_ENDOFPROMPT_ID, LLMConfig, QwenConfig,
    llm_config_from_doc, llm_family_of,
)
from cosyvoice_fast.config.yamlfile import ConfigError, field_types, read_hyperpyyaml, require


#: the model families this package serves: the yaml's llm and flow classes that name each (their ``tag``s)
FAMILY_CLASSES = {"cosyvoice2": ("Qwen2LM", "CausalMaskedDiffWithXvec"),
                  "cosyvoice3": ("CosyVoice3LM", "CausalMaskedDiffWithDiT")}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the three networks need, read from a model directory.

    ``family`` picks the networks: ``cosyvoice2`` (``flow`` a :class:`FlowConfig`, ``hift`` a :class:`HiFTConfig`)
    or ``cosyvoice3`` (``flow`` a ``config.dit.DiTFlowConfig``, ``hift`` a ``config.causal_hift.CausalHiFTConfig``).
    ``sample_rate``, ``token_mel_ratio`` and ``chunk_size`` mean the same in both: the engine reads only these."""

    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    chunk_size: int = 25
    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: Any = field(default_factory=FlowConfig)
    hift: Any = field(default_factory=HiFTConfig)
    family: str = "cosyvoice2"

    def __post_init__(self) -> None:
        if self.family not in FAMILY_CLASSES:
            raise ConfigError(f"unknown model family {self.family!r}; choose one of {', '.join(FAMILY_CLASSES)}")

    @classmethod
    def from_files(cls, yaml_path: str | Path, qwen_json: str | Path) -> "ModelConfig":
        """Build from ``cosyvoice2.yaml`` or ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json`` (the yaml's
        classes say the family); errors name file and field."""
        doc = read_hyperpyyaml(yaml_path)
        qwen = _qwen_from_json(Path(qwen_json))
        return _model_from_doc(doc, qwen, Path(yaml_path).name)


def _qwen_from_json(path: Path) -> QwenConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path.parent.name}/{path.name}: cannot be read as JSON ({e})") from e
    names = [f.name for f in fields(QwenConfig)]
    missing = [n for n in names if n not in raw and n != "tie_word_embeddings"]
    if missing:
        raise ConfigError(f"{path.parent.name}/{path.name}: missing field(s) {', '.join(missing)}; "
                          "is this the Qwen2 config shipped with CosyVoice2?")
    return QwenConfig(**{n: raw[n] for n in names if n in raw})


def _model_from_doc(doc: dict[str, Any], qwen: QwenConfig, fname: str) -> ModelConfig:
    """The numbers both families share, read here; the flow and vocoder from the family's own readers."""
    llm = require(doc, "llm", "", fname)
    flow = require(doc, "flow", "", fname)
    require(doc, "hift", "", fname)
    family = model_family(llm, flow, fname)
    read_flow, read_hift = _READERS[family]
    with field_types(fname):
        return ModelConfig(
            family=family,
            sample_rate=int(require(doc, "sample_rate", "", fname)),
            token_frame_rate=int(require(doc, "token_frame_rate", "", fname)),
            token_mel_ratio=int(require(doc, "token_mel_ratio", "", fname)),
            chunk_size=int(doc.get("chunk_size", 25)),
            llm=llm_config_from_doc(llm, qwen, fname),
            flow=read_flow(doc, fname),
            hift=read_hift(doc, fname))


#: each family's readers of the yaml's ``flow`` and ``hift`` sections
_READERS = {"cosyvoice2": (flow_config_from_doc, hift_config_from_doc),
            "cosyvoice3": (dit_flow_config_from_doc, causal_hift_config_from_doc)}


def model_family(llm: Any, flow: Any, fname: str) -> str:
    """The family whose llm and flow classes the yaml names (:data:`FAMILY_CLASSES`); a mix or an unknown pair
    (CosyVoice1) is refused naming both classes."""
    llm_cls, flow_cls = (str(getattr(x, "tag", "")).split(".")[-1] for x in (llm, flow))
    for family, (lm, fl) in FAMILY_CLASSES.items():
        if llm_cls == lm and flow_cls == fl:
            return family
    known = "; ".join(f"{f}: {lm} + {fl}" for f, (lm, fl) in FAMILY_CLASSES.items())
    raise ConfigError(f"{fname}: llm is {llm_cls or '?'} and flow is {flow_cls or '?'}, which is no model family "
                      f"cosyvoice_fast runs ({known}; not CosyVoice1, and not a mix). Point --model-dir at a "
                      "CosyVoice2-0.5B or Fun-CosyVoice3-0.5B directory.")


def tiny_config() -> ModelConfig:
    """The sizes of ``shared/fixtures/cosyvoice2-tiny`` (used by ``--synthetic tiny``)."""
    return ModelConfig(
        llm=LLMConfig(llm_input_size=64, llm_output_size=64,
                      qwen=QwenConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=1000)),
        flow=FlowConfig(vocab_size=1000,
                        encoder=EncoderConfig(attention_heads=4, linear_units=128, num_blocks=1),
                        decoder=DecoderConfig(channels=(64,), attention_head_dim=16, n_blocks=1,
                                              num_mid_blocks=2, num_heads=2)),
        hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
    )


def full_config() -> ModelConfig:
    """The CosyVoice2-0.5B sizes (used by ``--synthetic full``)."""
    return ModelConfig()
