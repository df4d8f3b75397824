"""CosyVoice3's DiT estimator as the ``cudagraph`` flow stage captures it: cuBLAS GEMMs, Triton glue between them.

Same calling convention and numbers as the eager :class:`~cosyvoice_fast.flow.model.dit.DiT` (fp32: within
1e-5 on the fixture; bf16: one rounding per fused site instead of one per eager op).  Why: at one request's
CFG pair (2 x 112 frames) the eager DiT replayed as a CUDA graph is ~1140 launches, 3.65 ms on an H100, of
which ~1.5 ms are AdaLN elementwise launches and ~1.06 ms cuDNN's grouped position convs; its GEMMs are
nearly all the useful work.  Here a block is 8 launches:

1. ``qkv = h @ Wqkv^T + b`` -- one cuBLAS GEMM over the concatenated q/k/v weights;
2. rotary on head 0 of q and k, in place (:mod:`~cosyvoice_fast.flow.kernels.dit_rotary`);
3. attention with the chunk rule as an index rule (:mod:`~cosyvoice_fast.flow.kernels.estimator_attention`);
4. the out-projection (cuBLAS);
5. ``x += gate · y`` and the MLP's modulated LayerNorm in one pass (:mod:`~cosyvoice_fast.flow.kernels.dit_norm`);
6. the MLP's first GEMM with bias and tanh-GELU in cuBLASLt's epilogue (``torch._addmm_activation``, bf16/fp16;
   fp32 and CPU, where that op's GELU is the erf form, a separate tanh GELU);
7. the MLP's second GEMM;
8. ``x += gate · y`` and the *next* block's attention LayerNorm (the last block: the output norm) in one pass.

The input side is 4 launches: the packing kernel of CosyVoice2's fused estimator (``[x | mu | spk | cond]``
rows; the projection's columns permuted once to match), the projection GEMM, and the two causal grouped
convs + Mish (:mod:`~cosyvoice_fast.flow.kernels.dit_conv`, the residual add in the second's epilogue).

Modulations: every AdaLN vector depends only on the flow time.  A direct call computes them per batch row
from ``t`` (the eager module's GEMMs, concatenated); a graph runner's step graphs use the table of
:meth:`BlasDiT.time_table` (one row per Euler step, filled outside capture), and ``tall`` -- the step's index,
a device scalar -- selects the row inside the norm kernels, so a step graph reads no AdaLN weight at all
(22 x 6 x 1024² of them: ~85 µs of HBM time per forward in bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.flow.kernels.dit_conv import causal_conv_mish
from cosyvoice_fast.flow.kernels.dit_norm import modulated_norm
from cosyvoice_fast.flow.kernels.dit_rotary import rotary_qk_
from cosyvoice_fast.flow.kernels.dit_table import StepTable, check_packable, key_rows, pack_shared, packed_key
from cosyvoice_fast.flow.kernels.estimator_attention import attention
from cosyvoice_fast.flow.kernels.estimator_fused import pack_inputs
from cosyvoice_fast.flow.model.dit import DiT

EPS = 1e-6


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``gelu_tanh(x @ weight^T + bias)``: for 16-bit rows on CUDA one cuBLASLt launch (GELU epilogue, tanh
    form); fp32 -- the parity reference, compared with eager at 1e-4 -- keeps PyTorch's own tanh GELU, so its
    numbers do not depend on the epilogue's approximation (and on CPU that op's GELU is the erf form anyway)."""
    if x.is_cuda and x.dtype != torch.float32:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


class BlasDiT(StepTable, nn.Module):
    """The DiT's forward on cuBLAS GEMMs and fused Triton glue, reading (and packing once) the weights of ``dit``.

    Packed weights are made on first use in the module's current device/dtype and remade when they change
    (``.to()`` of the wrapped DiT).  ``n_steps``: rows of the modulation table (the CFM's Euler steps)."""

    def __init__(self, dit: DiT, n_steps: int = 10):
        super().__init__()
        check_packable(dit.cfg, "BlasDiT")
        self.est = dit
        self.cfg = dit.cfg
        self.n_steps = int(n_steps)
        self._times: tuple[float, ...] | None = None  # the schedule the table holds
        self._packed: dict | None = None

    @property
    def width(self) -> int:
        """Columns of one modulation row: six vectors per block, then the output norm's scale and shift."""
        return (6 * self.cfg.depth + 2) * self.cfg.dim

    def packed(self) -> dict:
        est = self.est
        if self._packed is not None and self._packed["key"] == packed_key(est):
            return self._packed
        w0 = est.proj_out.weight
        self._packed = {**pack_shared(est), "inv_freq": est.rotary_embed.inv_freq.float().contiguous(),
                        "table": torch.zeros(self.n_steps, self.width, device=w0.device, dtype=w0.dtype)}
        self._times = None
        return self._packed

    def modulations(self, t: Tensor, batch: int) -> Tensor:
        """(1 or ``batch``, :attr:`width`) modulation rows for the flow time ``t`` (one shared, or per row):
        every block's [shift, scale, gate, shift, scale, gate], then the output norm's [scale, shift].  One
        shared row when ``t`` is a single time or one broadcast (stride 0, as a step graph passes it): the
        table's own computation, so both give the same bits."""
        est = self.est
        t = t.reshape(-1)
        shared = t.numel() == 1 or t.stride(0) == 0
        temb = est.time_act(t[:1] if shared else t, 1 if shared else batch)
        return torch.cat([b.attn_norm.linear(temb) for b in est.transformer_blocks] + [est.norm_out.linear(temb)],
                         dim=1)

    def step_modulation(self, t: Tensor, packed: dict) -> Tensor:
        """The modulation row of one flow time (:class:`~.dit_table.StepTable` fills its table with these)."""
        return self.modulations(t, 1)[0]

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False, tall: Tensor | None = None) -> Tensor:
        """The velocity (B, 80, T).  ``tall``: this forward's row of :meth:`time_table` (then ``t`` is not read
        and the modulations come from the table)."""
        b, _, frames = x.shape
        keys = key_rows(mask, x)
        est, c, p = self.est, self.cfg, self.packed()
        d, inner = c.dim, c.inner_dim
        if tall is None:
            mods, sel = self.modulations(t, b), None
        else:
            mods, sel = p["table"], tall.reshape(-1)[:1]
        h0 = F.linear(pack_inputs(x, mu, spks, cond), p["proj_w"], est.input_embed.proj.bias)
        (w1, b1), (w2, b2) = p["convs"]
        h = causal_conv_mish(causal_conv_mish(h0, w1, b1, frames), w2, b2, frames, residual=h0)
        hn = modulated_norm(h, mods, 0, d, frames, sel=sel, eps=EPS)
        chunk = c.static_chunk_size if streaming else 0
        fin = 6 * c.depth * d  # the output norm: scale, then shift
        for i, block in enumerate(est.transformer_blocks):
            o = 6 * i * d  # shift, scale, gate (attention), shift, scale, gate (MLP)
            w_qkv, b_qkv = p["qkv"][i]
            qkv = F.linear(hn, w_qkv, b_qkv)
            rotary_qk_(qkv, frames, inner, p["inv_freq"])
            att = attention(qkv, keys, b, c.heads, c.dim_head, chunk)
            out = block.attn.to_out[0]
            y = F.linear(att, out.weight, out.bias)
            hn = modulated_norm(h, mods, o + 3 * d, o + 4 * d, frames, y=y, gate=o + 2 * d, sel=sel, eps=EPS)
            ff = block.ff.ff
            y = F.linear(linear_gelu(hn, ff[0][0].weight, ff[0][0].bias), ff[2].weight, ff[2].bias)
            shift, scale = (o + 6 * d, o + 7 * d) if i + 1 < c.depth else (fin + d, fin)
            hn = modulated_norm(h, mods, shift, scale, frames, y=y, gate=o + 5 * d, sel=sel, eps=EPS)
        out = F.linear(hn, est.proj_out.weight, est.proj_out.bias)
        return out.view(b, frames, -1).transpose(1, 2)
