"""The CFM estimator as a chain of fused Triton kernels, with the eager estimator's call signature.

:class:`FusedEstimator` wraps a :class:`~cosyvoice_fast.flow.model.decoder.CausalConditionalDecoder` and
computes the same function (``(x, mask, mu, t, spks, cond, streaming) -> (B, 80, T)`` velocity) over
channels-last activations (one row per frame, ``B·T`` rows), so that a transformer block is five kernels
(LayerNorm+q/k/v, attention, out-projection+residual, the feed-forward as two GEMMs with LayerNorm, GELU and
the residual fused in) and a ResNet block two (see ``estimator_conv``).  The time embedding of every ResNet
block is one GEMM for all of them.  The whole forward is a fixed sequence of launches with no host
synchronisation, so the graph runner of the ``cudagraph`` flow captures it unchanged.  Every launch setting and
tile comes from the :class:`~cosyvoice_fast.flow.kernels.tuning.FlowTuning` given at construction.  At many
rows (a later chunk, or a batched solve of several requests) the GEMMs take the many-rows path
(:mod:`~cosyvoice_fast.flow.kernels.estimator_cublas`: cuBLAS, or tall Triton tiles with the epilogue fused
in): there arithmetic, not launches, sets the time.  That path takes no LayerNorm prologue, so there each
residual-producing GEMM's epilogue also writes the LayerNorm that the next GEMM needs (the block's ``norm3``,
the next block's ``norm1``), and only a group's first ``norm1`` is a pass of its own.

Weights are read from the wrapped modules: linear weights directly (views), convolution weights and the
concatenated q/k/v and time-embedding weights as packed copies made on first use and re-made whenever the
module's parameters change device, dtype or storage (``.to()``, a reload).

Only the released one-level U-Net is supported (``channels`` of length 1): it is the layout every checkpoint
ships and the one whose resampling convolutions are causal.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from cosyvoice_fast.flow.model.decoder import GELU_APPROXIMATION, CausalConditionalDecoder, SelfAttention
from cosyvoice_fast.flow.kernels.estimator_attention import attention
from cosyvoice_fast.flow.kernels.estimator_conv import causal_conv, pack_conv_weight, row_epilogue
from cosyvoice_fast.flow.kernels.estimator_cublas import use_many_rows
from cosyvoice_fast.flow.kernels.estimator_linear import (
    ACT_GELU, ACT_MISH, ACT_SILU, PRO_LN, PRO_MISH, PRO_NONE, PRO_SINUS, linear,
)
from cosyvoice_fast.flow.kernels.estimator_window import attention_cached, update_conv_context
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start


@triton.jit
def _pack_kernel(x_ptr, mu_ptr, spk_ptr, cond_ptr, out_ptr, T, C, sxb, sxc, smb, smc, ssb, scb, scc,
                 BT: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """(B, C, T) x, mu, cond and (B, C) speaker -> rows ``b·T + t`` of ``[x | mu | spk | cond]`` (4·C wide)."""
    b = tl.program_id(1)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rc = tl.arange(0, BC)
    ok = (rt[:, None] < T) & (rc[None, :] < C)
    row = out_ptr + (b * T + rt[:, None]) * (4 * C)
    pdl_start(PDL)
    x = tl.load(x_ptr + b * sxb + rc[None, :] * sxc + rt[:, None], mask=ok, other=0.0)
    tl.store(row + rc[None, :], x, mask=ok)
    mu = tl.load(mu_ptr + b * smb + rc[None, :] * smc + rt[:, None], mask=ok, other=0.0)
    tl.store(row + C + rc[None, :], mu, mask=ok)
    s = tl.load(spk_ptr + b * ssb + rc, mask=rc < C, other=0.0)
    tl.store(row + 2 * C + rc[None, :], tl.zeros([BT, BC], dtype=s.dtype) + s[None, :], mask=ok)
    c = tl.load(cond_ptr + b * scb + rc[None, :] * scc + rt[:, None], mask=ok, other=0.0)
    tl.store(row + 3 * C + rc[None, :], c, mask=ok)


def pack_inputs(x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, tuning: FlowTuning | None = None) -> Tensor:
    """The estimator's concatenated input ``[x, mu, spks, cond]`` as (B·T, 4·C) channels-last rows."""
    b, c, t = x.shape
    for name, z in (("mu", mu), ("cond", cond)):
        if z.shape != (b, c, t):
            raise ValueError(f"estimator input {name} must be ({b}, {c}, {t}) like x, got {tuple(z.shape)}")
    if spks.shape != (b, c):
        raise ValueError(f"estimator input spks must be ({b}, {c}), got {tuple(spks.shape)}")
    x, mu, cond = (z if z.stride(2) == 1 else z.contiguous() for z in (x, mu, cond))
    spks = spks if spks.stride(1) == 1 else spks.contiguous()
    out = torch.empty(b * t, 4 * c, device=x.device, dtype=x.dtype)
    bt = 32
    _pack_kernel[(triton.cdiv(t, bt), b)](
        x, mu, spks, cond, out, T=t, C=c, sxb=x.stride(0), sxc=x.stride(1), smb=mu.stride(0), smc=mu.stride(1),
        ssb=spks.stride(0), scb=cond.stride(0), scc=cond.stride(1), BT=bt, BC=max(16, triton.next_power_of_2(c)),
        num_warps=4, **(tuning or default_tuning()).pdl_kwargs(x, b * t))
    return out


def _frequencies(dim: int, device: torch.device) -> Tensor:
    """The fp32 frequencies of :func:`~cosyvoice_fast.flow.model.decoder.sinusoidal_embedding`, by the same
    expression (so the fused time features are bit-identical before the sin/cos)."""
    half = dim // 2
    return torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))


def _ln(norm: nn.LayerNorm) -> tuple[Tensor, Tensor, float]:
    return norm.weight, norm.bias, float(norm.eps)


class _Window:
    """A :class:`~cosyvoice_fast.flow.model.incremental.StaticWindow`'s buffers handed out in layer order:
    keys/values per attention layer, context columns per causal conv (the order the eager
    :func:`~cosyvoice_fast.flow.model.incremental.estimator_increment` visits them), plus the one-element
    device tensors ``start`` (the window's first absolute frame), ``valid`` (its real frames) and ``commit``
    (the window frame whose left columns become the next context)."""

    def __init__(self, win: object):
        self.kv, self.ctx = win.kv, win.ctx
        self.start, self.valid = win.pos[:1], win.valid
        self.commit = {left: idx[:1] for left, idx in win.ctx_index.items()}
        self.n_attn = self.n_conv = 0

    def next_kv(self) -> Tensor:
        self.n_attn += 1
        return self.kv[self.n_attn - 1]

    def next_ctx(self) -> Tensor:
        self.n_conv += 1
        return self.ctx[self.n_conv - 1]


class FusedEstimator(nn.Module):
    """``forward(x, mask, mu, t, spks, cond, streaming) -> (B, 80, T)``, the estimator's function and call
    signature, computed by the fused kernels of ``cosyvoice_fast.flow.kernels.estimator_*`` (CUDA, or the Triton
    interpreter on CPU).  Any attention head size: the attention kernels pad it to a power of two inside."""

    def __init__(self, estimator: CausalConditionalDecoder, resnet_split_ln: bool | None = None,
                 tuning: FlowTuning | None = None):
        """``resnet_split_ln=True`` runs each ResNet conv as a GEMM spread over output channels plus a row-wise
        LayerNorm pass (:func:`row_epilogue`) instead of one whole-row kernel that streams the whole weight
        from few programs (two launches more per ResNet block); ``None`` (default) splits for forwards of at
        most ``tuning.split_ln_max_rows`` rows, where the whole-row kernel has too few programs to fill the GPU
        (one request's CFG pair is a few hundred rows; at 8 rows x 206 frames the whole-row kernel was as fast).
        ``tuning``: every kernel's launch settings and tiles (``None``: :func:`~.tuning.default_tuning`)."""
        super().__init__()
        self.resnet_split_ln = resnet_split_ln
        self.tuning = tuning or default_tuning()
        cfg = estimator.cfg
        if len(cfg.channels) != 1:
            raise ValueError(f"the fused estimator supports one U-Net level (channels of length 1), got "
                             f"channels={tuple(cfg.channels)}; use the 'cudagraph' flow backend instead")
        if GELU_APPROXIMATION.get(cfg.act_fn) != "none":
            raise ValueError(f"the fused estimator computes the erf GELU; act_fn {cfg.act_fn!r} is not supported")
        self.est = estimator
        self._packed: dict[str, object] | None = None
        self._key: tuple | None = None

    @property
    def cfg(self):  # noqa: ANN201 - DecoderConfig (GraphEstimator reads cfg.out_channels)
        return self.est.cfg

    def _resnets(self) -> list[nn.Module]:
        est = self.est
        return [est.down_blocks[0][0]] + [mb[0] for mb in est.mid_blocks] + [est.up_blocks[0][0]]

    def _weights_key(self) -> tuple:
        # buffers too: SelfAttention.fuse() swaps the q/k/v weights for views of a new fused buffer
        return tuple((p.data_ptr(), p.dtype, p.device) for p in (*self.est.parameters(), *self.est.buffers()))

    def packed(self) -> dict[str, object]:
        """Packed copies of the conv, q/k/v and time-embedding weights (re-made when the parameters change)."""
        key = self._weights_key()
        if self._packed is not None and key == self._key:
            return self._packed
        est = self.est
        resnets = self._resnets()
        with torch.no_grad():
            p: dict[str, object] = {
                "resnets": [
                    {"w1": pack_conv_weight(r.block1.block[0].weight), "w2": pack_conv_weight(r.block2.block[0].weight),
                     "wr": r.res_conv.weight.detach()[:, :, 0].contiguous()} for r in resnets],
                "temb_w": torch.cat([r.mlp[1].weight.detach() for r in resnets]).contiguous(),
                "temb_b": torch.cat([r.mlp[1].bias.detach() for r in resnets]).contiguous(),
                # the fused q/k/v tensor of SelfAttention.fuse when present (no second copy), else one made here
                "qkv": {id(a): a.qkv_weight if a._fused() else
                        torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]).detach().contiguous()
                        for a in est.modules() if isinstance(a, SelfAttention)},
                "down": pack_conv_weight(est.down_blocks[0][2].weight),
                "up": pack_conv_weight(est.up_blocks[0][2].weight),
                "final": pack_conv_weight(est.final_block.block[0].weight),
                "proj": est.final_proj.weight.detach()[:, :, 0].contiguous(),
                # the frequencies of sinusoidal_embedding (same expression, so bit-identical)
                "freqs": _frequencies(est.cfg.in_channels, est.final_proj.weight.device),
            }
        self._packed, self._key = p, key
        return p

    def _conv(self, win: _Window | None, x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, frames: int,
              **kw: object) -> Tensor:
        """:func:`causal_conv`; in an incremental window it reads the conv's context columns and then stores
        the new ones (after the conv has read the old)."""
        if win is None:
            return causal_conv(x, mask, weight, bias, frames, tuning=self.tuning, **kw)
        ctx = win.next_ctx()
        y = causal_conv(x, mask, weight, bias, frames, ctx=ctx, tuning=self.tuning, **kw)
        update_conv_context(x, ctx, win.commit[ctx.shape[2]], frames, x2=kw.get("x2"), tuning=self.tuning)
        return y

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, **kw: object) -> Tensor:
        """:func:`linear` under this estimator's tuning."""
        return linear(x, weight, bias, tuning=self.tuning, **kw)

    def _split(self, rows: int) -> bool:
        """Whether a forward over ``rows`` rows runs its ResNet convs spread over output channels."""
        return self.resnet_split_ln if self.resnet_split_ln is not None else rows <= self.tuning.split_ln_max_rows

    def _resnet(self, i: int, r: nn.Module, h: Tensor, skip: Tensor | None, mask: Tensor, frames: int,
                tall: Tensor, p: dict, win: _Window | None = None) -> Tensor:
        """ResNet block ``i``: two convs, each with its LayerNorm in its epilogue or (:meth:`_split`) as a pass."""
        w = p["resnets"][i]
        n = r.block1.block[0].weight.shape[0]
        res = torch.empty(h.shape[0], n, device=h.device, dtype=h.dtype)
        vec = tall[:, i * n:(i + 1) * n]
        b1, b2, conv = r.block1.block, r.block2.block, self._conv
        if self._split(h.shape[0]):
            y1 = conv(win, h, mask, w["w1"], b1[0].bias, frames, x2=skip, res_weight=w["wr"],
                      res_bias=r.res_conv.bias, res_out=res)
            h1 = row_epilogue(y1, mask, _ln(b1[2]), frames, act=ACT_MISH, vec=vec, tuning=self.tuning)
            y2 = conv(win, h1, mask, w["w2"], b2[0].bias, frames)
            return row_epilogue(y2, mask, _ln(b2[2]), frames, act=ACT_MISH, residual=res, tuning=self.tuning)
        h1 = conv(win, h, mask, w["w1"], b1[0].bias, frames, x2=skip, ln=_ln(b1[2]), act=ACT_MISH, out_mask=True,
                  vec=vec, res_weight=w["wr"], res_bias=r.res_conv.bias, res_out=res)
        return conv(win, h1, mask, w["w2"], b2[0].bias, frames, ln=_ln(b2[2]), act=ACT_MISH, out_mask=True,
                    residual=res)

    def _transformer(self, blk: nn.Module, h: Tensor, mask: Tensor, batch: int, chunk: int, p: dict,
                     normed: Tensor | None = None, next_ln: tuple[Tensor, Tensor, float] | None = None,
                     win: _Window | None = None) -> tuple[Tensor, Tensor | None]:
        """One transformer block over the rows ``h``; returns the new rows and, when this block's last GEMM took
        the many-rows path with ``next_ln`` given, ``LayerNorm_next(new rows)`` written by its epilogue (else
        None).

        ``normed`` is ``norm1(h)`` when the previous block's epilogue already wrote it.  On the many-rows path
        (:func:`~cosyvoice_fast.flow.kernels.estimator_cublas.use_many_rows`) a LayerNorm is a launch of
        its own, so each residual-producing GEMM (out-projection, second feed-forward GEMM) also writes the
        following LayerNorm of its output and the next GEMM runs without a prologue; below that the fused
        GEMMs apply the LayerNorm in their prologue for free, so nothing changes there.  In an incremental
        window (``win``) attention also reads and extends the layer's cached keys and values."""
        a, ff, tn, linear = blk.attn1, blk.ff.net, self.tuning, self._linear
        fuse_ln = use_many_rows(h.shape[0], ff[2].weight, PRO_NONE, tn)
        if normed is None:
            qkv = linear(h, p["qkv"][id(a)], prologue=PRO_LN, ln=_ln(blk.norm1))
        else:
            qkv = linear(normed, p["qkv"][id(a)])
        if win is not None:
            o = attention_cached(qkv, win.next_kv(), win.start, win.valid, a.heads, a.head_dim, chunk, tuning=tn)
        else:
            o = attention(qkv, mask, batch, a.heads, a.head_dim, chunk, tuning=tn)
        n3 = torch.empty_like(h) if fuse_ln else None
        h = linear(o, a.to_out[0].weight, a.to_out[0].bias, residual=h,
                   norm_out=None if n3 is None else (n3, _ln(blk.norm3)))
        if n3 is not None:
            hid = linear(n3, ff[0].proj.weight, ff[0].proj.bias, act=ACT_GELU)
        else:
            hid = linear(h, ff[0].proj.weight, ff[0].proj.bias, prologue=PRO_LN, ln=_ln(blk.norm3), act=ACT_GELU)
        n1 = torch.empty_like(h) if fuse_ln and next_ln is not None else None
        h = linear(hid, ff[2].weight, ff[2].bias, residual=h, norm_out=None if n1 is None else (n1, next_ln))
        return h, n1

    def _transformers(self, tblocks: nn.ModuleList, h: Tensor, mask: Tensor, batch: int, chunk: int,
                      p: dict, win: _Window | None = None) -> Tensor:
        """One group of consecutive transformer blocks; each block's last GEMM may write the next block's
        ``norm1`` of its output (see :meth:`_transformer`), which is why the group is walked here as a unit."""
        normed = None
        for j, blk in enumerate(tblocks):
            next_ln = _ln(tblocks[j + 1].norm1) if j + 1 < len(tblocks) else None
            h, normed = self._transformer(blk, h, mask, batch, chunk, p, normed=normed, next_ln=next_ln, win=win)
        return h

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False, tall: Tensor | None = None) -> Tensor:
        """The velocity (B, 80, T).  ``tall``: this forward's row of :meth:`time_table` (then ``t`` is not
        read)."""
        b, _, frames = x.shape
        if mask.shape != (b, 1, frames):
            raise ValueError(f"estimator mask must be ({b}, 1, {frames}), got {tuple(mask.shape)}")
        if tall is not None and tall.shape != (b, self.time_width()):
            raise ValueError(f"estimator tall must be ({b}, {self.time_width()}), got {tuple(tall.shape)}")
        chunk = self.est.cfg.static_chunk_size if streaming else 0
        m = mask.reshape(b * frames)
        if m.dtype != x.dtype or not m.is_contiguous():
            m = m.to(x.dtype).contiguous()
        return self._run(x, m, mu, t, spks, cond, chunk, None, tall=tall)

    def time_width(self) -> int:
        """Columns of a :meth:`time_table` row: every ResNet block's time projection side by side."""
        return sum(r.mlp[1].weight.shape[0] for r in self._resnets())

    def _time_rows(self, t: Tensor, p: dict) -> Tensor:
        """(rows, :meth:`time_width`) for the flow times ``t`` (rows,): sinusoid -> SiLU -> linear -> Mish -> every
        ResNet block's projection, three GEMMs that read nothing but ``t``."""
        tm, linear = self.est.time_mlp, self._linear
        temb = linear(t, tm.linear_1.weight, tm.linear_1.bias, prologue=PRO_SINUS, act=ACT_SILU, freqs=p["freqs"])
        temb = linear(temb, tm.linear_2.weight, tm.linear_2.bias)
        return linear(temb, p["temb_w"], p["temb_b"], prologue=PRO_MISH)

    def time_table(self, ts: Tensor, rows: int) -> Tensor:
        """(len(ts), rows, :meth:`time_width`): the time projections of every Euler step of a solve, each for
        ``rows`` rows, computed by the same kernels at the same row count as a forward of ``rows`` rows (so
        ``forward(..., tall=table[i])`` equals ``forward(..., t=ts[i])`` bit for bit).  The times of a solve are
        the same for every solve, so a graph runner fills this once and its forwards skip three launches."""
        p = self.packed()
        with torch.no_grad():
            return torch.stack([self._time_rows(ts[i:i + 1].expand(rows).contiguous(), p)
                                for i in range(ts.shape[0])])

    def forward_window(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, win: object) -> Tensor:
        """The estimator on an incremental window (every frame valid, chunk-causal attention over the
        window's cached keys): :func:`~cosyvoice_fast.flow.model.incremental.estimator_increment` with a
        :class:`~cosyvoice_fast.flow.model.incremental.StaticWindow` ``win`` (which must also carry ``valid``,
        the window's real frame count as a one-element tensor, and may carry ``tall``, this step's row of
        :meth:`time_table`)."""
        chunk = self.est.cfg.static_chunk_size
        if chunk <= 0:
            raise ValueError("an incremental window needs chunk-causal attention (static_chunk_size > 0)")
        m = torch.ones(x.shape[0] * x.shape[2], device=x.device, dtype=x.dtype)
        return self._run(x, m, mu, t, spks, cond, chunk, _Window(win), tall=getattr(win, "tall", None))

    def _run(self, x: Tensor, m: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: int,
             win: _Window | None, tall: Tensor | None = None) -> Tensor:
        """The forward over packed rows; ``m`` is the (B·T,) row mask; ``tall`` the time projections when given
        (else computed from ``t``)."""
        est = self.est
        p = self.packed()
        b, _, frames = x.shape
        if tall is None:
            tall = self._time_rows(t.reshape(b), p)
        h = pack_inputs(x, mu, spks, cond, self.tuning)
        resnet, tblocks, down = est.down_blocks[0]
        i = 0
        h = self._resnet(i, resnet, h, None, m, frames, tall, p, win)
        h = self._transformers(tblocks, h, m, b, chunk, p, win)
        skip = h
        h = self._conv(win, h, m, p["down"], down.bias, frames)
        for resnet, tblocks in est.mid_blocks:
            i += 1
            h = self._resnet(i, resnet, h, None, m, frames, tall, p, win)
            h = self._transformers(tblocks, h, m, b, chunk, p, win)
        resnet, tblocks, up = est.up_blocks[0]
        i += 1
        h = self._resnet(i, resnet, h, skip, m, frames, tall, p, win)
        h = self._transformers(tblocks, h, m, b, chunk, p, win)
        h = self._conv(win, h, m, p["up"], up.bias, frames)
        fb = est.final_block.block
        h = self._conv(win, h, m, p["final"], fb[0].bias, frames, ln=_ln(fb[2]), act=ACT_MISH, out_mask=True)
        return self._linear(h, p["proj"], est.final_proj.bias, rowmask=m, out_btc=(b, frames))
