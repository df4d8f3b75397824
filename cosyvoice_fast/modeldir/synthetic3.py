"""The ``cosyvoice3.yaml`` of a synthetic CosyVoice3 directory (``--synthetic tiny3`` / ``full3``).

Written in upstream's tagged layout with the sizes below substituted (the model entries only: the training-only
entries of the official file are left out), and read back by the same reader as a downloaded directory, so a
synthetic CosyVoice3 directory exercises the real loader.  ``full3`` has Fun-CosyVoice3-0.5B's sizes (Qwen2 896 x
24 layers, DiT 1024 x 22 blocks of 16 x 64 heads, HiFT 512 channels): GPU timing; ``tiny3`` the parity fixture's.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_fast.config.model import QwenConfig


@dataclass(frozen=True, slots=True)
class Sizes3:
    """What differs between the tiny and the full CosyVoice3 (every format constant is the real one)."""

    qwen: QwenConfig
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_dim_head: int
    pre_lookahead_channels: int
    hift_channels: int


SIZES3 = {
    "tiny3": Sizes3(QwenConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=96, vocab_size=1000),
                    dit_dim=64, dit_depth=2, dit_heads=4, dit_dim_head=16, pre_lookahead_channels=64,
                    hift_channels=32),
    "full3": Sizes3(QwenConfig(), dit_dim=1024, dit_depth=22, dit_heads=16, dit_dim_head=64,
                    pre_lookahead_channels=1024, hift_channels=512),
}


def cosyvoice3_yaml(s: Sizes3) -> str:
    """The yaml text for sizes ``s`` (the Qwen2 sizes go to ``CosyVoice-BlankEN/config.json``)."""
    h = s.qwen.hidden_size
    return f"""# synthetic CosyVoice3 model written by cosyvoice_fast.modeldir.synthetic (random weights)
sample_rate: 24000
llm_input_size: {h}
llm_output_size: {h}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {s.pre_lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {s.dit_dim}
            depth: {s.dit_depth}
            heads: {s.dit_heads}
            dim_head: {s.dit_dim_head}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.hift_channels}
"""
