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


from cosyvoice_fast.config.cosyvoice2 import (  # noqa: F401 - re-exported: their home before CosyVoice3
    CFMConfig, DecoderConfig, EncoderConfig, FlowConfig, HiFTConfig,
)
from cosyvoice_fast.config.llm import (  # noqa: F401 - re-exported: the LM's config lives in config.llm
    CV3_EXTRA_ROWS, CV3_MAX_SILENT_RUN, CV3_SILENT_TOKENS, LLM_FAMILIES, REAL_ENDOFPROMPT_ID, LLMConfig, QwenConfig,
    llm_config_from_doc, llm_family_of,
)
from cosyvoice_fast.config.yamlfile import ConfigError, read_hyperpyyaml



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


def _get(d: Any, key: str, where: str, fname: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"{fname}: missing field {where}{key}; is this a CosyVoice2 or CosyVoice3 model directory?")
    return d[key]


def _model_from_doc(doc: dict[str, Any], qwen: QwenConfig, fname: str) -> ModelConfig:
    llm = _get(doc, "llm", "", fname)
    flow = _get(doc, "flow", "", fname)
    hift = _get(doc, "hift", "", fname)
    family = model_family(llm, flow, fname)
    if family == "cosyvoice3":
        return _cosyvoice3_from_doc(doc, qwen, fname)
    enc = _get(flow, "encoder", "flow.", fname)
    dec = _get(flow, "decoder", "flow.", fname)
    est = _get(dec, "estimator", "flow.decoder.", fname)
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm) if isinstance(cfm, dict) else {}
    istft = _get(hift, "istft_params", "hift.", fname)
    f0p = _get(hift, "f0_predictor", "hift.", fname)
    try:
        return ModelConfig(
            sample_rate=int(_get(doc, "sample_rate", "", fname)),
            token_frame_rate=int(_get(doc, "token_frame_rate", "", fname)),
            token_mel_ratio=int(_get(doc, "token_mel_ratio", "", fname)),
            chunk_size=int(doc.get("chunk_size", 25)),
            llm=llm_config_from_doc(llm, qwen, fname),
            flow=FlowConfig(
                input_size=int(_get(flow, "input_size", "flow.", fname)),
                output_size=int(_get(flow, "output_size", "flow.", fname)),
                spk_embed_dim=int(_get(flow, "spk_embed_dim", "flow.", fname)),
                vocab_size=int(_get(flow, "vocab_size", "flow.", fname)),
                token_mel_ratio=int(_get(flow, "token_mel_ratio", "flow.", fname)),
                pre_lookahead_len=int(_get(flow, "pre_lookahead_len", "flow.", fname)),
                encoder=EncoderConfig(
                    input_size=int(_get(enc, "input_size", "flow.encoder.", fname)),
                    output_size=int(_get(enc, "output_size", "flow.encoder.", fname)),
                    attention_heads=int(_get(enc, "attention_heads", "flow.encoder.", fname)),
                    linear_units=int(_get(enc, "linear_units", "flow.encoder.", fname)),
                    num_blocks=int(_get(enc, "num_blocks", "flow.encoder.", fname)),
                    static_chunk_size=int(enc.get("static_chunk_size", 0) or 0),
                    pre_lookahead_len=int(_get(flow, "pre_lookahead_len", "flow.", fname)),
                ),
                decoder=DecoderConfig(
                    in_channels=int(_get(est, "in_channels", "flow.decoder.estimator.", fname)),
                    out_channels=int(_get(est, "out_channels", "flow.decoder.estimator.", fname)),
                    channels=tuple(int(c) for c in _get(est, "channels", "flow.decoder.estimator.", fname)),
                    attention_head_dim=int(_get(est, "attention_head_dim", "flow.decoder.estimator.", fname)),
                    n_blocks=int(_get(est, "n_blocks", "flow.decoder.estimator.", fname)),
                    num_mid_blocks=int(_get(est, "num_mid_blocks", "flow.decoder.estimator.", fname)),
                    num_heads=int(_get(est, "num_heads", "flow.decoder.estimator.", fname)),
                    act_fn=str(est.get("act_fn", "gelu")),
                    static_chunk_size=int(est.get("static_chunk_size", 50)),
                    num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
                ),
                cfm=CFMConfig(
                    in_channels=int(_get(dec, "in_channels", "flow.decoder.", fname)),
                    spk_emb_dim=int(_get(dec, "spk_emb_dim", "flow.decoder.", fname)),
                    sigma_min=float(cfm.get("sigma_min", 1e-6)),
                    t_scheduler=str(cfm.get("t_scheduler", "cosine")),
                    inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
                ),
            ),
            hift=HiFTConfig(
                in_channels=int(_get(hift, "in_channels", "hift.", fname)),
                base_channels=int(_get(hift, "base_channels", "hift.", fname)),
                nb_harmonics=int(_get(hift, "nb_harmonics", "hift.", fname)),
                sampling_rate=int(_get(hift, "sampling_rate", "hift.", fname)),
                nsf_alpha=float(_get(hift, "nsf_alpha", "hift.", fname)),
                nsf_sigma=float(_get(hift, "nsf_sigma", "hift.", fname)),
                nsf_voiced_threshold=float(_get(hift, "nsf_voiced_threshold", "hift.", fname)),
                upsample_rates=tuple(int(r) for r in _get(hift, "upsample_rates", "hift.", fname)),
                upsample_kernel_sizes=tuple(int(r) for r in _get(hift, "upsample_kernel_sizes", "hift.", fname)),
                istft_n_fft=int(_get(istft, "n_fft", "hift.istft_params.", fname)),
                istft_hop_len=int(_get(istft, "hop_len", "hift.istft_params.", fname)),
                resblock_kernel_sizes=tuple(int(r) for r in _get(hift, "resblock_kernel_sizes", "hift.", fname)),
                resblock_dilation_sizes=tuple(tuple(int(x) for x in r)
                                              for r in _get(hift, "resblock_dilation_sizes", "hift.", fname)),
                source_resblock_kernel_sizes=tuple(
                    int(r) for r in _get(hift, "source_resblock_kernel_sizes", "hift.", fname)),
                source_resblock_dilation_sizes=tuple(
                    tuple(int(x) for x in r) for r in _get(hift, "source_resblock_dilation_sizes", "hift.", fname)),
                lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
                audio_limit=float(hift.get("audio_limit", 0.99)),
                f0_num_class=int(f0p.get("num_class", 1)),
                f0_in_channels=int(_get(f0p, "in_channels", "hift.f0_predictor.", fname)),
                f0_cond_channels=int(_get(f0p, "cond_channels", "hift.f0_predictor.", fname)),
            ),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{fname}: a field has the wrong type ({e})") from e


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


def _cosyvoice3_from_doc(doc: dict[str, Any], qwen: QwenConfig, fname: str) -> ModelConfig:
    """CosyVoice3: the shared numbers here, the DiT flow and causal HiFT from their own readers."""
    from cosyvoice_fast.config.causal_hift import causal_hift_config_from_doc
    from cosyvoice_fast.config.dit import dit_flow_config_from_doc

    try:
        return ModelConfig(
            family="cosyvoice3",
            sample_rate=int(_get(doc, "sample_rate", "", fname)),
            token_frame_rate=int(_get(doc, "token_frame_rate", "", fname)),
            token_mel_ratio=int(_get(doc, "token_mel_ratio", "", fname)),
            chunk_size=int(doc.get("chunk_size", 25)),
            llm=llm_config_from_doc(_get(doc, "llm", "", fname), qwen, fname),
            flow=dit_flow_config_from_doc(doc, fname),
            hift=causal_hift_config_from_doc(doc, fname))
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{fname}: a field has the wrong type ({e})") from e


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
