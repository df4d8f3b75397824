"""The flow's token encoder with its Conformer blocks as fused Triton kernels (the ``fused`` flow backend).

:class:`FusedEncoder` computes :meth:`~cosyvoice_fast.flow.model.flow.CausalMaskedDiffWithXvec.encode_padded` (same
call, same values within float rounding) for the encoder graphs of
:class:`~cosyvoice_fast.flow.graph_encoder.GraphEncoder`.  Eagerly a Conformer block is ~20 launches (three
projections, the position projection, bias adds, the position product with its shift, scale and mask fill, the
attention call, the out-projection, two norms, the feed-forward and residual adds), so the graph of a first
chunk's encoder is a few hundred launch-bound kernels.  Here a block is five kernels over channels-last rows (one
row per token or frame, ``B·T`` rows):

1. LayerNorm + q/k/v projection (:func:`~.estimator_linear.linear` with its LayerNorm prologue);
2. relative-position attention with the padding and chunk masks as index rules (:mod:`.encoder_attention`);
3. out-projection + bias + residual;
4. LayerNorm + first feed-forward GEMM + SiLU;
5. second feed-forward GEMM + bias + residual.

The relative-position table of a length is a constant (built once per length, outside any capture); its
projection by every block of a stage is ONE GEMM per stage, each block reading its column slice.  The final
LayerNorm, the 80-channel projection and the (B, 80, T) transpose are one GEMM storing the mel layout.  The
rest (embeddings, the look-ahead and upsampling convolutions) is a handful of PyTorch kernels, as eagerly.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from cosyvoice_fast.flow.model.flow import FlowEncoding
from cosyvoice_fast.flow.model.encoder_layers import relative_position_table
from cosyvoice_fast.flow.kernels.encoder_attention import relpos_attention
from cosyvoice_fast.flow.kernels.estimator_fused import _ln
from cosyvoice_fast.flow.kernels.estimator_linear import ACT_SILU, PRO_LN, linear
from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning

class FusedEncoder(nn.Module):
    """``encode_padded(ids, full_lens, body_lens, embedding, streaming) -> FlowEncoding``, the flow model's
    padded encode, with the Conformer blocks on fused kernels (CUDA, or the Triton interpreter on CPU)."""

    def __init__(self, flow: nn.Module, tuning: FlowTuning | None = None):
        """``tuning``: the kernels' launch settings and tiles, ``tuning.encoder_gemms`` saying how each GEMM kind
        runs at few rows (``None``: :func:`~.tuning.default_tuning`)."""
        super().__init__()
        self.tuning = tuning or default_tuning()
        self.flow = flow
        self._packed: dict[str, object] | None = None
        self._key: tuple | None = None
        self._tables: dict[tuple, Tensor] = {}
        self._lock = threading.Lock()

    def _weights_key(self) -> tuple:
        return tuple((p.data_ptr(), p.dtype, p.device) for p in self.flow.encoder.parameters())

    def packed(self) -> dict[str, object]:
        """Per stage: each block's concatenated q/k/v weight and bias, and every block's position projection
        stacked into one (blocks·D, D) weight (re-made when the parameters change device, dtype or storage)."""
        key = self._weights_key()
        if self._packed is not None and key == self._key:
            return self._packed
        enc = self.flow.encoder
        with torch.no_grad():
            p: dict[str, object] = {}
            for name, blocks in (("low", enc.encoders), ("up", enc.up_encoders)):
                attn = [b.self_attn for b in blocks]
                p[name] = {
                    "qkv_w": [torch.cat([a.linear_q.weight, a.linear_k.weight, a.linear_v.weight]).contiguous()
                              for a in attn],
                    "qkv_b": [torch.cat([a.linear_q.bias, a.linear_k.bias, a.linear_v.bias]).contiguous()
                              for a in attn],
                    "pos_w": torch.cat([a.linear_pos.weight for a in attn]).contiguous() if attn else None,
                }
        self._packed, self._key = p, key
        return p

    def _table(self, t: int, d: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The (2t-1, d) relative-position table, built once per length: a constant of every graph of that
        length (built during a graph's warm-up run, never inside its capture)."""
        key = (t, d, device, dtype)
        table = self._tables.get(key)
        if table is None:
            table = relative_position_table(t, t, d, device, dtype)[0]
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:  # a table made inside a capture is only filled at replay: never share it
                with self._lock:
                    self._tables[key] = table
        return table

    def _gemm(self, kind: str, x: Tensor, weight: Tensor, bias: Tensor | None = None, **kw: object) -> Tensor:
        """``linear(x, weight, bias, **kw)`` run the way ``tuning.encoder_gemms`` says for ``kind``."""
        t = self.tuning
        how = t.encoder_gemms.get(kind)
        few = (x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= t.oneshot_max_rows)
        if how is None or not few:
            return linear(x, weight, bias, tuning=t, **kw)
        if how == "rowtiled":
            return linear(x, weight, bias, oneshot=False, tuning=t, **kw)
        if how == "cublas" and bias is None and not kw:
            return torch.nn.functional.linear(x, weight)
        if not isinstance(how, str):
            return linear_oneshot(x, weight, bias, tiles=how, tuning=t, **kw)
        return linear(x, weight, bias, tuning=t, **kw)

    def _stage(self, x: Tensor, blocks: nn.ModuleList, p: dict, lengths: Tensor, len_scale: int,
               chunk: int) -> Tensor:
        """Conformer blocks over x (B, T, D); returns the (B·T, D) rows."""
        b, t, d = x.shape
        h = x.reshape(b * t, d).contiguous()
        if not len(blocks):
            return h
        pos = self._gemm("pos", self._table(t, d, x.device, x.dtype), p["pos_w"])  # (2t-1, blocks·d)
        for i, blk in enumerate(blocks):
            a, ff = blk.self_attn, blk.feed_forward
            qkv = self._gemm("qkv", h, p["qkv_w"][i], p["qkv_b"][i], prologue=PRO_LN, ln=_ln(blk.norm_mha))
            o = relpos_attention(qkv, pos[:, i * d:(i + 1) * d], a.pos_bias_u, a.pos_bias_v, lengths, b,
                                 a.n_heads, a.d_k, chunk, len_scale, tuning=self.tuning)
            h = self._gemm("out", o, a.linear_out.weight, a.linear_out.bias, residual=h)
            hid = self._gemm("ff1", h, ff.w_1.weight, ff.w_1.bias, prologue=PRO_LN, ln=_ln(blk.norm_ff), act=ACT_SILU)
            h = self._gemm("ff2", hid, ff.w_2.weight, ff.w_2.bias, residual=h)
        return h

    def encode_padded(self, ids: Tensor, full_lens: Tensor, body_lens: Tensor, embedding: Tensor,
                      streaming: bool = False) -> FlowEncoding:
        """The flow model's ``encode_padded`` (its docstring says what the rows and lengths mean)."""
        flow = self.flow
        enc = flow.encoder
        cfg = enc.cfg
        p = self.packed()
        spks = flow.speaker_condition(embedding)
        b, t = ids.shape
        x = enc.embed(flow.embed_tokens(ids, full_lens))
        inside = torch.arange(t, device=ids.device).unsqueeze(0) < full_lens.to(ids.device).unsqueeze(1)
        x = enc.pre_lookahead_layer(x * inside.unsqueeze(-1).to(x.dtype))
        chunk = cfg.static_chunk_size if streaming else 0
        stride = cfg.upsample_stride
        lengths = body_lens.to(ids.device)
        h = self._stage(x, enc.encoders, p["low"], lengths, 1, chunk)
        d = h.shape[1]
        x = enc.up_layer(h.view(b, t, d).transpose(1, 2)).transpose(1, 2)
        h = self._stage(enc.up_embed(x), enc.up_encoders, p["up"], lengths, stride, chunk * stride)
        mu = self._gemm("proj", h, flow.encoder_proj.weight, flow.encoder_proj.bias, prologue=PRO_LN,
                        ln=_ln(enc.after_norm), out_btc=(b, t * stride))
        return FlowEncoding(mu, spks)

    forward = encode_padded
