"""CausalMaskedDiffWithDiT (CosyVoice3's flow): speech tokens + prompt + speaker vector -> 80-bin mel at 50 Hz.

No conformer encoder: token embedding -> :class:`PreLookahead` (residual conv pair, ``pre_lookahead_len``
tokens of right look-ahead) -> repeat ``token_mel_ratio`` times along time = ``mu``; then CosyVoice2's guided
CFM (fixed noise, cosine schedule, Euler, CFG) with the DiT estimator (:mod:`cosyvoice_fast.flow.model.dit`).

It offers CosyVoice2's flow interface (``cfg.vocab_size``, ``cfg.token_mel_ratio``, :meth:`encode`,
:meth:`decode`, :meth:`decode_batch`), so the chunk helpers of :mod:`cosyvoice_fast.flow.eager` drive it as
they drive CosyVoice2's flow.  Streaming semantics (as upstream): with ``finalize=False`` the last
``pre_lookahead_len`` tokens are only look-ahead context for the tokens before them; ``streaming=True`` makes
the DiT's attention chunk-causal (50-frame chunks from the prompt's first frame).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.dit import DiTFlowConfig
from cosyvoice_fast.flow.model.cfm import GuidedCFM
from cosyvoice_fast.flow.model.dit import DiT
from cosyvoice_fast.flow.model.encoder_layers import PreLookahead
from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec, FlowEncoding


class DiTFlow(nn.Module):
    """The flow model of CosyVoice3; attribute names match the keys of its flow.pt."""

    def __init__(self, cfg: DiTFlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookahead(cfg.input_size, cfg.pre_lookahead_len, cfg.pre_lookahead_channels)
        self.decoder = GuidedCFM(cfg.cfm, DiT(cfg.dit), cfg.dit.out_channels)

    # The CFM half is CosyVoice2's, unchanged: it reads only ``cfg.cfm`` and ``decoder`` (the guided solve).
    decode = CausalMaskedDiffWithXvec.decode
    decode_batch = CausalMaskedDiffWithXvec.decode_batch
    speaker_condition = CausalMaskedDiffWithXvec.speaker_condition
    embed_tokens = CausalMaskedDiffWithXvec.embed_tokens

    def lookahead(self, rows: Tensor, finalize: bool, n_lookahead: int | None = None) -> Tensor:
        """(B, N, C) embedded tokens -> :class:`PreLookahead` output for the encoded ones.

        ``finalize``: all N tokens are encoded (zeros after the end).  Otherwise the last ``n_lookahead``
        (default ``pre_lookahead_len``) are context only and N - n_lookahead rows come back."""
        n_ctx = self.cfg.pre_lookahead_len if n_lookahead is None else n_lookahead
        if finalize or n_ctx <= 0:
            return self.pre_lookahead_layer(rows)
        if n_ctx > rows.shape[1]:
            raise ValueError(f"{rows.shape[1]} tokens cannot hold {n_ctx} look-ahead tokens")
        return self.pre_lookahead_layer(rows[:, :-n_ctx], context=rows[:, -n_ctx:])

    def encode(self, token: Tensor, token_len: Tensor, prompt_token: Tensor, prompt_token_len: Tensor,
               embedding: Tensor, streaming: bool = False, finalize: bool = True,
               n_lookahead: int | None = None) -> FlowEncoding:
        """Tokens -> ``mu`` (B, 80, ratio * encoded tokens) and the speaker condition.

        ``streaming`` is accepted for CosyVoice2's signature; nothing before the DiT attends, so it changes
        nothing here."""
        del streaming
        spks = self.speaker_condition(embedding)
        ids = torch.cat((prompt_token, token), dim=1)
        rows = self.embed_tokens(ids, prompt_token_len + token_len)
        h = self.lookahead(rows, finalize, n_lookahead)
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2).contiguous()
        return FlowEncoding(mu, spks)

    @torch.inference_mode()
    def inference(self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                  streaming: bool = False, finalize: bool = True) -> Tensor:
        """Upstream's ``flow.inference`` for one utterance: the mel (1, 80, T_new) after the prompt's frames.

        ``prompt_feat`` (1, T_p, 80): its ``T_p`` frames are the condition on the first frames (upstream
        trusts ``prompt_feat.shape[1]``; a prompt mel longer than the prompt tokens' frames is refused)."""
        if token.shape[0] != 1:
            raise ValueError("flow inference runs one utterance at a time (batch size 1)")
        dev = embedding.device
        tlen = torch.tensor([token.shape[1]], device=dev)
        plen = torch.tensor([prompt_token.shape[1]], device=dev)
        enc = self.encode(token, tlen, prompt_token, plen, embedding, finalize=finalize)
        return self.decode(enc.mu, enc.spks, prompt_feat, streaming=streaming)


def load_dit_flow(cfg: DiTFlowConfig, state: dict[str, Tensor]) -> DiTFlow:
    """A :class:`DiTFlow` with ``state`` (flow.pt) loaded strictly; a mismatch names the keys and the sizes."""
    flow = DiTFlow(cfg)
    try:
        flow.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"flow.pt does not match cosyvoice3.yaml's flow sizes: {e}") from e
    return flow.eval()

