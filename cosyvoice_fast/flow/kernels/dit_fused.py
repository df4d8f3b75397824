"""CosyVoice3's DiT estimator on Triton kernels: AdaLN folded into GEMM prologues, rotary in one in-place pass,
attention with the chunk rule as an index rule.  Same calling convention and numbers as the eager
:class:`~cosyvoice_fast.flow.model.dit.DiT` (fp32: within 1e-4), about 9 launches per block instead of ~25.

What is fused, and why it is exact:

* **Modulations.**  Every AdaLN vector depends only on the flow time, and the CFM calls the estimator with one
  time for all rows (the Euler step's), so ``SiLU(temb)`` is one row and every block's six vectors plus the
  final two come from ONE GEMM over the concatenated ``attn_norm`` / ``norm_out`` weights.  The ``1 +`` of each
  scale is folded into that GEMM's bias, so its output holds the LayerNorm gammas directly.
* **Modulated LayerNorm.**  ``LN(x) · (1 + scale) + shift`` is a LayerNorm with gamma ``1 + scale`` and beta
  ``shift`` (shared by all rows), which the GEMM kernels of :mod:`~cosyvoice_fast.flow.kernels.estimator_linear`
  apply as their prologue: q/k/v (one GEMM, weights concatenated), the MLP's first GEMM and ``proj_out``
  (which stores the (B, 80, T) layout itself).
* **Rotary** on head 0 of q and k in place (:mod:`~cosyvoice_fast.flow.kernels.dit_rotary`, one launch).
* **Attention**: CosyVoice2's estimator attention kernel (:mod:`~cosyvoice_fast.flow.kernels.estimator_attention`):
  key mask and ``j < (i // C + 1) · C`` as an index rule, never a (T, T) tensor; a padding row with no valid
  key gives 0 instead of attending to frame 0 (never read).
* **Inputs**: the packing kernel of CosyVoice2's fused estimator writes ``[x | mu | spk | cond]`` rows; the
  projection's columns are permuted once to that order.  The causal position convs are Triton tensor-core
  kernels on the channels-last rows (:mod:`~cosyvoice_fast.flow.kernels.dit_conv`; cuDNN's grouped conv plus
  its layout transposes cost ~1 ms a forward on an H100).

The gates (``x + gate · y``) are one ``addcmul`` each; GELU (tanh form, which the GEMM epilogue does not offer)
one launch.

Modulation table: the modulation GEMM reads every block's AdaLN weights (``6 · dim²`` per block: 280 MB in bf16
at full size, ~85 µs of HBM time per forward on an H100), yet a solve only ever asks for its ``n_steps`` Euler
times.  A graph runner's step graphs (:mod:`~cosyvoice_fast.flow.graph_solve`) call :meth:`FusedDiT.time_table`
once per filling, which computes the ``n_steps`` modulation rows into a table owned here (fixed address, read by
every graph) and hands back each step's index as that step's one-column ``tall``; ``forward(..., tall=...)`` then
reads its row (bit-identical to computing it: same kernels, same row).  One schedule per module: a different
one is refused rather than silently overwriting what captured graphs read.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.flow.kernels.dit_conv import causal_conv_mish
from cosyvoice_fast.flow.kernels.dit_rotary import rotary_qk_
from cosyvoice_fast.flow.kernels.dit_table import StepTable, check_packable, key_rows, pack_shared, packed_key
from cosyvoice_fast.flow.kernels.estimator_attention import attention
from cosyvoice_fast.flow.kernels.estimator_fused import pack_inputs
from cosyvoice_fast.flow.kernels.estimator_linear import ACT_SILU, PRO_LN, PRO_SINUS, linear
from cosyvoice_fast.flow.model.dit import DiT

EPS = 1e-6


class FusedDiT(StepTable, nn.Module):
    """The DiT's forward on fused kernels, reading (and packing once) the weights of ``dit``.

    Packed weights are made on first use in the module's current device/dtype and remade when they change
    (``.to()`` of the wrapped DiT)."""

    def __init__(self, dit: DiT, n_steps: int = 10):
        super().__init__()
        self.n_steps = int(n_steps)  # rows of the modulation table (the CFM's Euler steps)
        self._times: tuple[float, ...] | None = None  # the schedule the table holds
        check_packable(dit.cfg, "FusedDiT")
        self.est = dit
        self.cfg = dit.cfg
        self._packed: dict | None = None

    def packed(self) -> dict:
        est, c = self.est, self.cfg
        if self._packed is not None and self._packed["key"] == packed_key(est):
            return self._packed
        w0 = est.proj_out.weight
        d = c.dim
        with torch.no_grad():
            mods_w = torch.cat([b.attn_norm.linear.weight for b in est.transformer_blocks]
                               + [est.norm_out.linear.weight]).contiguous()
            mods_b = torch.cat([b.attn_norm.linear.bias for b in est.transformer_blocks]
                               + [est.norm_out.linear.bias]).clone()
            for i in range(c.depth):  # the scales (chunks 1 and 4 of each block's six) become gammas
                mods_b[(6 * i + 1) * d:(6 * i + 2) * d] += 1
                mods_b[(6 * i + 4) * d:(6 * i + 5) * d] += 1
            mods_b[6 * c.depth * d:(6 * c.depth + 1) * d] += 1  # norm_out: scale first, then shift
        half = c.time_freq_dim // 2
        freqs = torch.exp(torch.arange(half, device=w0.device, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
        table = torch.zeros(self.n_steps, mods_w.shape[0], device=w0.device, dtype=w0.dtype)
        self._packed = {**pack_shared(est), "mods_w": mods_w, "mods_b": mods_b,
                        "freqs": freqs, "inv_freq": est.rotary_embed.inv_freq.float().contiguous(), "table": table}
        self._times = None
        return self._packed

    def modulations(self, t: Tensor, p: dict) -> Tensor:
        """(1, depth·6·dim + 2·dim): every block's [shift, 1+scale, gate, shift, 1+scale, gate] and the final
        [1+scale, shift], for the flow time ``t[0]`` (the CFM's one time per call)."""
        tm = self.est.time_embed.time_mlp
        t1 = t.reshape(-1)[:1].contiguous()
        temb = linear(t1, tm[0].weight, tm[0].bias, prologue=PRO_SINUS, act=ACT_SILU, freqs=p["freqs"])
        temb = linear(temb, tm[2].weight, tm[2].bias, act=ACT_SILU)  # SiLU(temb): what every modulation reads
        return linear(temb, p["mods_w"], p["mods_b"])

    def step_modulation(self, t: Tensor, packed: dict) -> Tensor:
        """The modulation row of one flow time (:class:`~.dit_table.StepTable` fills its table with these)."""
        return self.modulations(t, packed)[0]

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False, tall: Tensor | None = None) -> Tensor:
        """The velocity (B, 80, T).  ``tall``: this forward's row of :meth:`time_table` (then ``t`` is not read
        and the modulations come from the table)."""
        b, _, frames = x.shape
        m = key_rows(mask, x)
        est, c, p = self.est, self.cfg, self.packed()
        d, inner = c.dim, c.inner_dim
        if tall is None:
            mods = self.modulations(t, p)[0]
        else:
            mods = p["table"].index_select(0, tall.reshape(-1)[:1].long())[0]
        h0 = linear(pack_inputs(x, mu, spks, cond), p["proj_w"], est.input_embed.proj.bias)
        (cw1, cb1), (cw2, cb2) = p["convs"]
        h = causal_conv_mish(causal_conv_mish(h0, cw1, cb1, frames), cw2, cb2, frames, residual=h0)
        chunk = c.static_chunk_size if streaming else 0
        for i, block in enumerate(est.transformer_blocks):
            v = mods[6 * i * d:6 * (i + 1) * d].view(6, d)  # shift, gamma, gate, shift, gamma, gate
            w_qkv, b_qkv = p["qkv"][i]
            qkv = linear(h, w_qkv, b_qkv, prologue=PRO_LN, ln=(v[1], v[0], EPS))
            rotary_qk_(qkv, frames, inner, p["inv_freq"])
            o = attention(qkv, m, b, c.heads, c.dim_head, chunk)
            out = block.attn.to_out[0]
            h = torch.addcmul(h, v[2], linear(o, out.weight, out.bias))
            ff = block.ff.ff
            y = F.gelu(linear(h, ff[0][0].weight, ff[0][0].bias, prologue=PRO_LN, ln=(v[4], v[3], EPS)),
                       approximate="tanh")
            h = torch.addcmul(h, v[5], linear(y, ff[2].weight, ff[2].bias))
        fin = mods[6 * c.depth * d:].view(2, d)  # gamma (1 + scale), shift
        out = torch.empty(b, c.mel_dim, frames, device=x.device, dtype=x.dtype)
        return linear(h, est.proj_out.weight, est.proj_out.bias, prologue=PRO_LN, ln=(fin[0], fin[1], EPS),
                      out=out, out_btc=(b, frames))
