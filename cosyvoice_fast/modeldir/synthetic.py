"""Synthetic model directories: the real file layout with deterministic random weights.

Timing does not depend on weight values, so GPU benchmarks and demos run on ``--synthetic full`` (CosyVoice2-0.5B
sizes) or ``--synthetic tiny`` (the parity fixture's sizes) without any download; ``full3`` / ``tiny3`` are the same
for CosyVoice3 (Fun-CosyVoice3-0.5B's sizes / its fixture's: ``cosyvoice3.yaml``, speech_tokenizer_v3.onnx).  The
directory is written in the official format (the family's yaml with hyperpyyaml tags, CosyVoice-BlankEN/config.json,
llm.pt, flow.pt, hift.pt and, for the frontend, tiny ONNX models and a byte-level BPE vocabulary) so that exactly
the same loader is exercised.
The audio it produces is noise: say so wherever it is shown.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from cosyvoice_fast.config.model import ModelConfig, QwenConfig, full_config, tiny_config
from cosyvoice_fast.modeldir.synthetic3 import SIZES3, cosyvoice3_yaml

log = logging.getLogger(__name__)

SIZES = {"tiny": tiny_config, "full": full_config}
#: every ``--synthetic`` name: CosyVoice2's sizes, then CosyVoice3's
SYNTHETIC_MODELS = (*SIZES, *SIZES3)


def _yaml_text(c: ModelConfig) -> str:
    """A cosyvoice2.yaml in the official tagged layout, carrying ``c``'s numbers (read back by config.py).  The
    model entries are complete, so upstream's own code builds the same networks from it
    (``benchmarks/upstream_ttfb.py``); the training-only entries of the official file are left out."""
    e, d, h, f = c.flow.encoder, c.flow.decoder, c.hift, c.flow
    return f"""# synthetic CosyVoice2 model written by cosyvoice_fast.modeldir.synthetic (random weights)
sample_rate: {c.sample_rate}
llm_input_size: {c.llm.llm_input_size}
llm_output_size: {c.llm.llm_output_size}
spk_embed_dim: {f.spk_embed_dim}
token_frame_rate: {c.token_frame_rate}
token_mel_ratio: {c.token_mel_ratio}
chunk_size: {c.chunk_size}
num_decoding_left_chunks: {d.num_decoding_left_chunks}
qwen_pretrain_path: ''

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {c.llm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {c.llm.top_p}
        top_k: {c.llm.top_k}
        win_size: {c.llm.win_size}
        tau_r: {c.llm.tau_r}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {f.input_size}
    output_size: {f.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {f.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {f.pre_lookahead_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        input_size: {e.input_size}
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: {f.cfm.in_channels}
        n_spks: 1
        spk_emb_dim: {f.cfm.spk_emb_dim}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {f.cfm.sigma_min}
                solver: 'euler'
                t_scheduler: {f.cfm.t_scheduler}
                training_cfg_rate: 0.2
                inference_cfg_rate: {f.cfm.inference_cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {d.in_channels}
            out_channels: {d.out_channels}
            channels: {list(d.channels)}
            dropout: 0.0
            attention_head_dim: {d.attention_head_dim}
            n_blocks: {d.n_blocks}
            num_mid_blocks: {d.num_mid_blocks}
            num_heads: {d.num_heads}
            act_fn: {d.act_fn}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {h.nsf_alpha}
    nsf_sigma: {h.nsf_sigma}
    nsf_voiced_threshold: {h.nsf_voiced_threshold}
    upsample_rates: {list(h.upsample_rates)}
    upsample_kernel_sizes: {list(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.istft_n_fft}
        hop_len: {h.istft_hop_len}
    resblock_kernel_sizes: {list(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: {[list(x) for x in h.resblock_dilation_sizes]}
    source_resblock_kernel_sizes: {list(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {[list(x) for x in h.source_resblock_dilation_sizes]}
    lrelu_slope: {h.lrelu_slope}
    audio_limit: {h.audio_limit}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: {h.f0_num_class}
        in_channels: {h.f0_in_channels}
        cond_channels: {h.f0_cond_channels}
"""


def _qwen_json(c: ModelConfig) -> dict:
    return _qwen_dict(c.llm.qwen)


def _qwen_dict(q: QwenConfig) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": q.hidden_size, "num_hidden_layers": q.num_hidden_layers,
            "num_attention_heads": q.num_attention_heads, "num_key_value_heads": q.num_key_value_heads,
            "intermediate_size": q.intermediate_size, "vocab_size": q.vocab_size, "rope_theta": q.rope_theta,
            "rms_norm_eps": q.rms_norm_eps, "tie_word_embeddings": q.tie_word_embeddings,
            "max_position_embeddings": 32768, "torch_dtype": "float32"}


def write_synthetic_model_dir(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                              with_frontend: bool = True) -> Path:
    """Write a complete model directory with random weights (seeded) and return its path.

    ``seed`` makes weights reproducible; the global RNG is forked so callers' random state is untouched.
    """
    from cosyvoice_fast.modeldir.files import build_modules, read_config, validate_model_dir

    if size not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic size {size!r}; choose one of {', '.join(SYNTHETIC_MODELS)}")
    out = Path(out_dir)
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    if size in SIZES:
        qwen, yaml_name, text = SIZES[size]().llm.qwen, "cosyvoice2.yaml", _yaml_text(SIZES[size]())
    else:
        qwen, yaml_name, text = SIZES3[size].qwen, "cosyvoice3.yaml", cosyvoice3_yaml(SIZES3[size])
    (out / yaml_name).write_text(text, encoding="utf-8")
    (out / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(_qwen_dict(qwen), indent=2), encoding="utf-8")
    for name in ("llm.pt", "flow.pt", "hift.pt"):  # so that the directory validates; written for real below
        (out / name).touch()
    cfg = read_config(validate_model_dir(out))  # what the loader will read: the yaml is the one truth
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        llm, flow, hift = build_modules(cfg)
        _tame_weights(llm, flow, hift)
    for name, module in (("llm.pt", llm), ("flow.pt", flow), ("hift.pt", hift)):
        tmp = out / f".{name}.tmp"
        torch.save(module.state_dict(), tmp)
        os.replace(tmp, out / name)
    if with_frontend:
        from cosyvoice_fast.modeldir.synthetic_frontend import write_frontend_files

        write_frontend_files(out, cfg, seed=seed)
    log.info("wrote synthetic %s model to %s", size, out)
    return out


def _tame_weights(llm: torch.nn.Module, flow: torch.nn.Module, hift: torch.nn.Module) -> None:
    """Scale random weights so activations stay finite through deep stacks (values are noise either way)."""
    with torch.no_grad():
        for module in (llm, flow):
            for name, p in module.named_parameters():
                if p.dim() >= 2 and "norm" not in name:
                    p.mul_(0.5)


def synthetic_model_dir(size: str, cache_root: str | Path | None = None) -> Path:
    """A cached synthetic directory (written once per size under ``cache_root`` or the temp dir)."""
    root = Path(cache_root) if cache_root else Path(tempfile.gettempdir()) / "cosyvoice_fast_synthetic"
    out = root / size
    marker = out / ".complete"
    if not marker.exists():
        write_synthetic_model_dir(out, size)
        marker.write_text("ok")
    return out
