"""CausalMaskedDiffWithXvec: speech tokens + prompt + speaker vector -> 80-bin mel at 50 Hz.

The work is split in two stages with separate methods so that backends can replace either one
(an incremental per-chunk encoder, a CUDA-graph or TensorRT estimator):

* :meth:`encode` - prompt tokens and new tokens are concatenated and embedded, run through the
  upsampling Conformer encoder and projected to 80 channels: ``mu`` covers prompt + new frames.
* :meth:`decode` - conditional flow matching from ``mu``; the prompt mel is the condition on the first
  frames and only the frames after the prompt are returned.

Streaming semantics (as upstream): with ``finalize=False`` the last ``pre_lookahead_len`` tokens are not
encoded themselves, they only feed the pre-look-ahead conv of the tokens before them, so the returned mel
covers ``2 * (n_prompt + n_tokens - pre_lookahead_len) - n_prompt_frames`` frames.  ``streaming=True`` makes
encoder and estimator attention chunk-causal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.config.model import FlowConfig
from cosyvoice_fast.flow.model.cfm import CausalCFM, Estimator
from cosyvoice_fast.flow.model.encoder import UpsampleConformerEncoder


class FlowEncoding(NamedTuple):
    """Output of :meth:`CausalMaskedDiffWithXvec.encode`."""

    mu: Tensor  # (B, 80, T_frames): encoder output projected to mel channels, prompt frames first
    spks: Tensor  # (B, 80): normalised speaker embedding after the affine layer


class CausalMaskedDiffWithXvec(nn.Module):
    """The flow model of CosyVoice2; attribute names match the keys of flow.pt."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalCFM(cfg.cfm, cfg.decoder)

    def speaker_condition(self, embedding: Tensor) -> Tensor:
        """(B, spk_embed_dim) x-vector -> (B, 80): L2-normalised first, so only its direction matters."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def embed_tokens(self, token: Tensor, token_len: Tensor) -> Tensor:
        """(B, T) ids -> (B, T, input_size); padding positions (and negative ids) give zero vectors."""
        valid = torch.arange(token.shape[1], device=token.device).unsqueeze(0) < token_len.to(token.device).unsqueeze(1)
        emb = self.input_embedding(token.clamp(min=0).long())
        return emb * valid.unsqueeze(-1).to(emb.dtype)

    def encode(self, token: Tensor, token_len: Tensor, prompt_token: Tensor, prompt_token_len: Tensor,
               embedding: Tensor, streaming: bool = False, finalize: bool = True,
               n_lookahead: int | None = None) -> FlowEncoding:
        """Tokens -> ``mu`` (B, 80, 2 * encoded tokens) and the speaker condition.

        ``n_lookahead`` (default ``pre_lookahead_len``) is how many trailing tokens serve as look-ahead only
        when ``finalize`` is False; fewer than the model's look-ahead are zero-padded like an utterance end.
        """
        spks = self.speaker_condition(embedding)
        ids = torch.cat((prompt_token, token), dim=1)
        lens = prompt_token_len + token_len
        x = self.embed_tokens(ids, lens)
        if finalize:
            h, _ = self.encoder(x, lens, streaming=streaming)
        else:
            n_ctx = self.cfg.pre_lookahead_len if n_lookahead is None else n_lookahead
            if n_ctx <= 0:
                h, _ = self.encoder(x, lens, streaming=streaming)
            else:
                body, context = x[:, :-n_ctx], x[:, -n_ctx:]
                h, _ = self.encoder(body, (lens - n_ctx).clamp(min=0), context=context, streaming=streaming)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()
        return FlowEncoding(mu, spks)

    def encode_padded(self, ids: Tensor, full_lens: Tensor, body_lens: Tensor, embedding: Tensor,
                      streaming: bool = False) -> FlowEncoding:
        """:meth:`encode` for right-padded rows of mixed lengths (a batch of different requests' calls).

        Row ``i`` of ``ids`` (B, T) holds prompt tokens then new tokens, ``full_lens[i]`` in all, of which the last
        ``full_lens[i] - body_lens[i]`` are look-ahead only (0 for a final call).  Returns ``mu`` (B, 80, stride*T),
        valid on each row's first ``stride * body_lens[i]`` frames, where it equals :meth:`encode` of that row
        within float rounding (:meth:`UpsampleConformerEncoder.forward_padded` says why).
        """
        spks = self.speaker_condition(embedding)
        x = self.embed_tokens(ids, full_lens)
        h, _ = self.encoder.forward_padded(x, full_lens, body_lens, streaming=streaming)
        return FlowEncoding(self.encoder_proj(h).transpose(1, 2).contiguous(), spks)

    def decode(self, mu: Tensor, spks: Tensor, prompt_feat: Tensor, streaming: bool = False,
               n_timesteps: int | None = None, noise: Tensor | None = None, *,
               estimator: Estimator | None = None) -> Tensor:
        """Flow matching from ``mu`` (B, 80, T) with the prompt mel (B, T_p, 80) as condition on its first
        T_p frames; returns the (B, 80, T - T_p) generated frames after the prompt, in fp32.

        ``estimator`` replaces the CFM's own estimator for every Euler step (a CUDA-graph or TensorRT runner
        with the same calling convention); ``None`` runs the module's eager estimator."""
        n_prompt = prompt_feat.shape[1]
        total = mu.shape[2]
        if n_prompt > total:
            raise ValueError(f"prompt mel has {n_prompt} frames but the tokens give only {total}")
        cond = torch.zeros(mu.shape[0], mu.shape[1], total, device=mu.device, dtype=mu.dtype)
        cond[:, :, :n_prompt] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = torch.ones(mu.shape[0], 1, total, device=mu.device, dtype=mu.dtype)
        steps = self.cfg.cfm.n_timesteps if n_timesteps is None else n_timesteps
        feat = self.decoder(mu, mask, spks.to(mu.dtype), cond, n_timesteps=steps, streaming=streaming, noise=noise,
                            estimator=estimator)
        return feat[:, :, n_prompt:].float()

    def decode_batch(self, mus: list[Tensor], spks: list[Tensor], prompt_feats: list[Tensor],
                     streaming: bool = False, n_timesteps: int | None = None, noise: Tensor | None = None, *,
                     estimator: Estimator | None = None) -> list[Tensor]:
        """:meth:`decode` for several utterances in ONE guided solve.

        ``mus[i]`` is (1, 80, T_i), ``spks[i]`` (1, 80), ``prompt_feats[i]`` (1, T_p_i, 80); all must share the
        attention mode (``streaming``).  Each ``mu`` is zero-padded on the right to ``T = max T_i`` with a mask
        of ones on its own ``T_i`` frames, its prompt mel fills its first ``T_p_i`` condition frames, and the
        CFM runs the 2B-row guided batch (:meth:`CausalCFM.solve_batch`).  Returns, per item, its
        (1, 80, T_i - T_p_i) generated frames in fp32 — what :meth:`decode` gives for that item alone.
        """
        if not (len(mus) == len(spks) == len(prompt_feats)) or not mus:
            raise ValueError("decode_batch needs one spks and one prompt_feat per mu (and at least one item)")
        lens = [int(m.shape[2]) for m in mus]
        n_prompts = [int(p.shape[1]) for p in prompt_feats]
        for i, (n, p) in enumerate(zip(lens, n_prompts)):
            if mus[i].shape[0] != 1:
                raise ValueError("decode_batch items are single utterances (batch 1 each)")
            if p > n:
                raise ValueError(f"item {i}: prompt mel has {p} frames but the tokens give only {n}")
        ref = mus[0]
        b, c, total = len(mus), ref.shape[1], max(lens)
        mu = torch.zeros(b, c, total, device=ref.device, dtype=ref.dtype)
        cond = torch.zeros_like(mu)
        mask = torch.zeros(b, 1, total, device=ref.device, dtype=ref.dtype)
        for i, (m, p, n, n_p) in enumerate(zip(mus, prompt_feats, lens, n_prompts)):
            mu[i, :, :n] = m[0]
            cond[i, :, :n_p] = p[0].transpose(0, 1).to(ref.dtype)
            mask[i, :, :n] = 1
        spk = torch.cat([s.reshape(1, -1) for s in spks]).to(ref.dtype)
        steps = self.cfg.cfm.n_timesteps if n_timesteps is None else n_timesteps
        feat = self.decoder.solve_batch(mu, mask, spk, cond, n_timesteps=steps, streaming=streaming, noise=noise,
                                        estimator=estimator)
        return [feat[i:i + 1, :, n_p:n].float() for i, (n, n_p) in enumerate(zip(lens, n_prompts))]

    @torch.inference_mode()
    def inference(self, token: Tensor, token_len: Tensor, prompt_token: Tensor, prompt_token_len: Tensor,
                  prompt_feat: Tensor, prompt_feat_len: Tensor, embedding: Tensor, streaming: bool = False,
                  finalize: bool = True) -> Tensor:
        """Upstream's ``flow.inference`` for one utterance: the mel (1, 80, T_new) after the prompt frames.

        ``prompt_feat_len`` is accepted for interface parity; as upstream, ``prompt_feat.shape[1]`` decides
        how many leading frames are prompt.
        """
        del prompt_feat_len
        if token.shape[0] != 1:
            raise ValueError("flow inference runs one utterance at a time (batch size 1)")
        enc = self.encode(token, token_len, prompt_token, prompt_token_len, embedding, streaming, finalize)
        return self.decode(enc.mu, enc.spks, prompt_feat, streaming=streaming)
