"""Model hyperparameters, read from the model directory as inert data.

The official model directory describes itself in ``cosyvoice2.yaml``, a hyperpyyaml file whose tags
(``!new:``, ``!name:``, ``!apply:``, ``!ref``) would import and instantiate classes if executed.  We never
execute it: a restricted YAML loader turns every tag into inert data, ``!ref <key>`` references are resolved
against the document, and the numbers are copied into the frozen dataclasses below.  The Qwen2 sizes come
from ``CosyVoice-BlankEN/config.json``.

Everything that can be wrong raises ``ConfigError`` (a ``ValueError``) naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


from cosyvoice_fast.config.yamlfile import ConfigError, read_hyperpyyaml



@dataclass(frozen=True, slots=True)
class QwenConfig:
    """The Qwen2 decoder inside the speech LM (from ``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("config.json: hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config.json: num_attention_heads must be divisible by num_key_value_heads")


@dataclass(frozen=True, slots=True)
class LLMConfig:
    """Qwen2LM: text+speech LM predicting 25 Hz speech tokens."""

    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    qwen: QwenConfig = field(default_factory=QwenConfig)

    @property
    def sos_id(self) -> int:
        return 0

    @property
    def task_id(self) -> int:
        return 1

    @property
    def eos_token(self) -> int:
        return self.speech_token_size

    @property
    def vocab_out(self) -> int:
        """Rows of ``llm_decoder`` / ``speech_embedding``: speech tokens + eos + 2 special."""
        return self.speech_token_size + 3


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """UpsampleConformerEncoder (rel-pos attention, pre-look-ahead, 2x upsampling, 4 up-blocks)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    static_chunk_size: int = 25
    pre_lookahead_len: int = 3
    upsample_stride: int = 2


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """CausalConditionalDecoder, the CFM estimator (a 1-D U-Net of ResNet + transformer blocks)."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1


@dataclass(frozen=True, slots=True)
class CFMConfig:
    """Conditional flow matching sampler settings."""

    in_channels: int = 240
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """CausalMaskedDiffWithXvec: speech tokens + prompt -> 80-bin mel at 50 Hz."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True, slots=True)
class HiFTConfig:
    """HiFTGenerator (NSF source + iSTFT HiFi-GAN) and its ConvRNN f0 predictor."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512

    @property
    def upsample_factor(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz)."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the three networks need, read from a model directory."""

    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    chunk_size: int = 25
    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)

    @classmethod
    def from_files(cls, yaml_path: str | Path, qwen_json: str | Path) -> "ModelConfig":
        """Build from ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json``; errors name file and field."""
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
        raise ConfigError(f"{fname}: missing field {where}{key}; is this a CosyVoice2 model directory?")
    return d[key]


def _model_from_doc(doc: dict[str, Any], qwen: QwenConfig, fname: str) -> ModelConfig:
    llm = _get(doc, "llm", "", fname)
    flow = _get(doc, "flow", "", fname)
    hift = _get(doc, "hift", "", fname)
    llm_cls = getattr(llm, "tag", "")
    flow_cls = getattr(flow, "tag", "")
    if "Qwen2LM" not in llm_cls or "CausalMaskedDiffWithXvec" not in flow_cls:
        raise ConfigError(
            f"{fname}: llm is {llm_cls.split('.')[-1] or '?'} and flow is {flow_cls.split('.')[-1] or '?'}; "
            "cosyvoice_fast runs CosyVoice2 (Qwen2LM + CausalMaskedDiffWithXvec), not CosyVoice1 or CosyVoice3. "
            "Point --model-dir at a CosyVoice2-0.5B directory.")
    sampling = llm.get("sampling", {}) or {}
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
            llm=LLMConfig(
                llm_input_size=int(_get(llm, "llm_input_size", "llm.", fname)),
                llm_output_size=int(_get(llm, "llm_output_size", "llm.", fname)),
                speech_token_size=int(_get(llm, "speech_token_size", "llm.", fname)),
                top_p=float(sampling.get("top_p", 0.8)),
                top_k=int(sampling.get("top_k", 25)),
                win_size=int(sampling.get("win_size", 10)),
                tau_r=float(sampling.get("tau_r", 0.1)),
                qwen=qwen,
            ),
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
