"""Chunk-by-chunk execution of the streaming flow (encoder and CFM estimator) with carried state.

In streaming mode every sequence operation of the flow looks only left or into a bounded window:

* attention (the encoder's two Conformer stacks and the estimator's transformer blocks) is chunk-causal with
  every earlier chunk visible, chunks counted from the first prompt token;
* convolutions are causal (left padding only), except the pre-look-ahead conv, which reaches
  ``pre_lookahead_len`` tokens to the right;
* everything else (LayerNorm, projections, feed-forwards, the CFG mix and the Euler update) is per frame, and
  the CFM start noise is indexed by absolute frame.

So the values of a *complete* chunk whose tokens all have their real look-ahead never change when more tokens
arrive.  This module keeps, for such a committed prefix, exactly what later positions read from it: key/value
tensors of every attention layer and the last ``kernel - 1`` input columns of every causal conv.  A chunk call
then runs only the positions from the committed boundary (a chunk boundary) to the end of the input.  Frames
of a partly filled chunk see each other, so they are recomputed until their chunk is complete; that is at most
one chunk of extra work.

State is kept as flat lists of tensors ("slots"), filled in the order the layers run, so one generic window
object serves every stack and the state serialises to a ``dict[str, Tensor]`` trivially.  This module holds the
windows and the estimator's increment; :mod:`~cosyvoice_fast.flow.model.incremental_encoder` the encoder's.

Pure math on the modules of :class:`~cosyvoice_fast.flow.model.flow.CausalMaskedDiffWithXvec`; no module is
modified and no parameter is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.flow.model.cfm import euler_schedule
from cosyvoice_fast.flow.model.decoder import sinusoidal_embedding


def chunk_visible(start: int, n_query: int, chunk: int, device: torch.device) -> Tensor:
    """bool (n_query, start + n_query): query at absolute position ``start + i`` may see key ``j``.

    Chunk-causal with every left chunk visible (the same rule as the full-sequence masks); ``start`` must be a
    chunk boundary so that all cached keys are in earlier chunks.
    """
    q = torch.arange(start, start + n_query, device=device)
    ends = (torch.div(q, chunk, rounding_mode="floor") + 1) * chunk
    keys = torch.arange(start + n_query, device=device)
    return keys.unsqueeze(0) < ends.unsqueeze(1)


class Window:
    """One incremental pass of one stack over absolute positions ``[start, start + n)``.

    ``slots`` is the committed state of positions ``[0, start)`` (read in layer order, or an empty list at the
    very beginning); the pass collects ``new``: the same slots extended by the first ``commit`` positions of the
    window.  ``start`` must be a multiple of ``chunk`` (committed prefixes always are).
    """

    def __init__(self, slots: list[Tensor], start: int, commit: int, chunk: int):
        if chunk <= 0:
            raise ValueError("incremental flow needs chunk-causal attention (static_chunk_size > 0)")
        if start % chunk:
            raise ValueError(f"window start {start} is not on a chunk boundary ({chunk})")
        self.old = slots
        self.new: list[Tensor] = []
        self.start, self.commit, self.chunk = start, commit, chunk
        self._visible: dict[int, Tensor] = {}

    def _take(self) -> Tensor | None:
        i = len(self.new)
        if not self.old:
            return None
        if i >= len(self.old):
            raise ValueError("flow state does not match the model (too few slots)")
        return self.old[i]

    def _keep(self, t: Tensor, full: bool) -> None:
        # A slice that is not the whole tensor is copied so the state does not pin the uncommitted tail.
        self.new.append(t if full else t.clone())

    def conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        """Causal (left-padded) stride-1 conv of ``x`` (B, C, n) with the carried left columns."""
        if conv.stride[0] != 1 or conv.dilation[0] != 1 or conv.groups != 1 or conv.padding[0] != 0:
            raise NotImplementedError("incremental conv supports stride 1, dilation 1, no padding only")
        left = conv.kernel_size[0] - 1
        ctx = self._take()
        if ctx is None:
            ctx = x.new_zeros(x.shape[0], x.shape[1], left)
        xp = torch.cat((ctx.to(x.dtype), x), dim=2)
        self._keep(xp[:, :, self.commit:self.commit + left], False)
        return F.conv1d(xp, conv.weight, conv.bias)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(B, H, n, d) new keys/values -> all keys/values ``[0, start + n)``; commits the first ``commit``."""
        old_k = self._take()
        if old_k is not None:
            old_v = self.old[len(self.new) + 1]
            k = torch.cat((old_k.to(k.dtype), k), dim=2)
            v = torch.cat((old_v.to(v.dtype), v), dim=2)
        keep = self.start + self.commit
        full = keep == k.shape[2]
        self._keep(k[:, :, :keep], full)
        self._keep(v[:, :, :keep], full)
        return k, v

    def visible(self, n_query: int, device: torch.device) -> Tensor:
        if n_query not in self._visible:
            self._visible[n_query] = chunk_visible(self.start, n_query, self.chunk, device)
        return self._visible[n_query]


def slots_nbytes(slots: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in slots)


# ------------------------------------------------------------------------------------------------ estimator


@dataclass
class DecoderCache:
    """Committed estimator state: ``n_frames`` frames; one slot list per Euler step (CFG batch of 2 inside)."""

    n_frames: int = 0
    steps: list[list[Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(slots_nbytes(s) for s in self.steps)


@dataclass(eq=False)
class StaticDecoderCache:
    """Committed estimator state in the fixed-size layout of a graph runner (:class:`StaticWindow`).

    ``kv`` (S, A, 2, 2, H, n_frames, d): per Euler step and attention layer, keys and values of the CFG pair;
    ``ctx``: per causal conv, (S, 2, C_in, kernel - 1).  Both are None while the state lives only in the
    runner's buffers (the runner saves them when another state needs the buffers); ``frame_bytes`` is what
    one frame of it occupies there, so :meth:`nbytes` reports the same size either way.
    """

    n_frames: int = 0
    kv: Tensor | None = None
    ctx: list[Tensor] | None = None
    frame_bytes: int = 0

    def nbytes(self) -> int:
        if self.kv is None:
            return self.n_frames * self.frame_bytes
        return slots_nbytes([self.kv, *(self.ctx or [])])


def check_estimator(est: nn.Module) -> None:
    """Only the released one-level U-Net is causal everywhere (stride-2 resampling would look ahead)."""
    if len(est.down_blocks) != 1 or len(est.up_blocks) != 1:
        raise NotImplementedError("incremental flow supports estimators with a single U-Net level "
                                  f"(channels of length 1), got {len(est.down_blocks)} levels")


def _causal_block(blk: nn.Module, x: Tensor, win: Window) -> Tensor:
    """CausalBlock1D with an all-ones mask: causal conv, then the per-frame rest of its Sequential."""
    return blk.block[1:](win.conv(blk.block[0], x))


def _resnet(r: nn.Module, x: Tensor, temb: Tensor, win: Window) -> Tensor:
    h = _causal_block(r.block1, x, win) + r.mlp(temb).unsqueeze(-1)
    h = _causal_block(r.block2, h, win)
    return h + r.res_conv(x)


def _self_attention(a: nn.Module, x: Tensor, win: Window) -> Tensor:
    b, t, _ = x.shape

    def heads(z: Tensor) -> Tensor:
        return z.view(b, t, a.heads, a.head_dim).transpose(1, 2)

    if a._fused():  # one GEMM for q/k/v (SelfAttention.fuse), and one write of the new keys/values
        qkv = F.linear(x, a.qkv_weight).view(b, t, 3, a.heads, a.head_dim).permute(2, 0, 3, 1, 4)
        q = qkv[0]
        k, v = win.write_kv(qkv[1:]) if hasattr(win, "write_kv") else win.keys_values(qkv[1], qkv[2])
    else:
        q = heads(a.to_q(x))
        k, v = win.keys_values(heads(a.to_k(x)), heads(a.to_v(x)))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=win.visible(t, x.device))
    return a.to_out[0](o.transpose(1, 2).reshape(b, t, -1))


def _transformers(blocks: nn.ModuleList, x: Tensor, win: Window) -> Tensor:
    h = x.transpose(1, 2)
    for blk in blocks:
        h = h + _self_attention(blk.attn1, blk.norm1(h), win)
        h = h + blk.ff(blk.norm3(h))
    return h.transpose(1, 2)


def estimator_increment(est: nn.Module, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                        win: Window) -> Tensor:
    """The estimator (batch B, all frames valid, streaming) on frames ``[win.start, win.start + n)``.

    x, mu, cond: (B, 80, n); t: (B,); spks: (B, 80).  Returns the (B, 80, n) velocity.
    """
    temb = est.time_mlp(sinusoidal_embedding(t, est.cfg.in_channels).to(x.dtype))
    h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
    (resnet, tblks, down), = est.down_blocks
    h = _transformers(tblks, _resnet(resnet, h, temb, win), win)
    skip = h
    h = win.conv(down, h)
    for resnet, tblks in est.mid_blocks:
        h = _transformers(tblks, _resnet(resnet, h, temb, win), win)
    (resnet, tblks, up), = est.up_blocks
    h = torch.cat([h, skip], dim=1)
    h = _transformers(tblks, _resnet(resnet, h, temb, win), win)
    h = win.conv(up, h)
    h = _causal_block(est.final_block, h, win)
    return est.final_proj(h)


def decode_increment(flow: nn.Module, mu: Tensor, spks: Tensor, cond: Tensor, x0: Tensor, cache: DecoderCache,
                     commit_end: int, n_timesteps: int | None = None) -> tuple[Tensor, DecoderCache]:
    """Guided Euler solve on frames ``[cache.n_frames, cache.n_frames + n)``.

    mu, cond, x0 (start noise): (1, 80, n) for those frames; spks (1, 80).  Frames before ``commit_end`` (rounded
    down to the estimator chunk) are committed.  Returns the (1, 80, n) mel in fp32 and the new cache.
    """
    cfm = flow.decoder
    est = cfm.estimator
    check_estimator(est)
    start, n = cache.n_frames, mu.shape[2]
    chunk = est.cfg.static_chunk_size
    new_start = max(start, (min(commit_end, start + n) // chunk) * chunk)
    steps = cfm.cfg.n_timesteps if n_timesteps is None else n_timesteps
    if cache.steps and len(cache.steps) != steps:
        raise ValueError(f"flow state has {len(cache.steps)} Euler steps, the solve runs {steps}")
    if n == 0:
        return x0.float(), cache
    windows = [Window(cache.steps[i] if cache.steps else [], start, new_start - start, chunk) for i in range(steps)]
    x = guided_solve(flow, x0, mu, spks, cond, windows)
    return x, DecoderCache(new_start, [w.new for w in windows])


def guided_solve(flow: nn.Module, x0: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, windows: list,
                 schedule: tuple[Tensor, Tensor] | None = None,
                 estimator: Callable[..., Tensor] | None = None) -> Tensor:
    """The classifier-free-guided Euler solve of the CFM, one estimator window per step (CFG batch of 2).

    ``windows`` decide where each step's keys/values and conv context come from: growing lists
    (:class:`Window`) or fixed-size buffers (:class:`StaticWindow`, the CUDA-graph path); the maths is the same.
    ``schedule``: the Euler ``(t, dt)`` on ``mu``'s device, precomputed (a graph capture cannot copy from the
    host).  ``estimator``: :func:`estimator_increment`'s signature without the module (default: that function
    on the flow's estimator; the ``fused`` backend passes its kernels).  Returns the (1, 80, n) mel in fp32.
    """
    cfm = flow.decoder
    est = cfm.estimator
    dtype = mu.dtype
    ts, dts = schedule or euler_schedule(len(windows), cfm.cfg.t_scheduler, mu.device, dtype)
    g_mu = torch.cat([mu, torch.zeros_like(mu)])
    g_spks = torch.cat([spks, torch.zeros_like(spks)]).to(dtype)
    g_cond = torch.cat([cond, torch.zeros_like(cond)]).to(dtype)
    w = cfm.cfg.inference_cfg_rate
    x = x0.to(dtype)
    run = estimator or (lambda *a: estimator_increment(est, *a))
    for i, win in enumerate(windows):
        v = run(torch.cat([x, x]), g_mu, ts[i].reshape(1).expand(2), g_spks, g_cond, win)
        x = x + dts[i] * ((1.0 + w) * v[:1] - w * v[1:])
    return x.float()


# ------------------------------------------------------------------------------ fixed-size state (CUDA graphs)


class StaticWindow:
    """A :class:`Window` over preallocated buffers, so that one captured graph serves every call of a shape.

    ``kv`` (A, 2, B, H, C, d): keys and values of the A attention layers for key positions ``[0, C)``; the new
    keys/values are written at ``pos`` (absolute positions of the window's frames) and attention reads all C
    positions under ``mask`` (n, C, additive: :func:`static_mask`), which hides both positions not yet written
    and later chunks.
    ``ctx``: per causal conv, its (B, C_in, kernel - 1) left columns; each conv reads them and writes back, in
    place, the columns left of position ``commit`` of the window (``ctx_index[kernel - 1]`` holds
    ``commit + arange(kernel - 1)``).  Positions, mask and indices are tensors, so they are graph inputs.
    ``valid`` (one element): the window's real frames, for kernels that apply the mask's rule themselves.
    ``tall``: this step's time projections for estimators that take them precomputed (the fused kernels'
    ``time_table`` row); the eager maths ignores it.
    """

    def __init__(self, kv: Tensor, ctx: list[Tensor], pos: Tensor, ctx_index: dict[int, Tensor], mask: Tensor,
                 valid: Tensor | None = None, tall: Tensor | None = None):
        self.kv, self.ctx, self.pos, self.ctx_index, self.mask = kv, ctx, pos, ctx_index, mask
        self.valid, self.tall = valid, tall
        self._attn = self._conv = 0

    def conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        left = conv.kernel_size[0] - 1
        ctx = self.ctx[self._conv]
        self._conv += 1
        xp = torch.cat((ctx, x), dim=2)
        torch.index_select(xp, 2, self.ctx_index[left], out=ctx)  # written after the cat read it
        return F.conv1d(xp, conv.weight, conv.bias)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.write_kv(torch.stack((k, v)))

    def write_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """(2, B, H, n, d) new keys and values -> all keys, all values (B, H, C, d); one copy kernel."""
        buf = self.kv[self._attn]
        self._attn += 1
        buf.index_copy_(3, self.pos, kv)
        return buf[0], buf[1]

    def visible(self, n_query: int, device: torch.device) -> Tensor:
        return self.mask


def static_mask(start: int, n_valid: int, n_query: int, capacity: int, chunk: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive (n_query, capacity) mask for a :class:`StaticWindow` at ``start`` (0 where visible, -inf
    elsewhere; additive so attention needs no bool-to-float conversion per layer): chunk-causal visibility of
    written keys (``< start + n_valid``); padded queries (rows ``>= n_valid``) see the keys of a query in
    their chunk, so no row is empty."""
    q = torch.arange(start, start + n_query, device=device)
    ends = (torch.div(q, chunk, rounding_mode="floor") + 1) * chunk
    keys = torch.arange(capacity, device=device)
    visible = keys.unsqueeze(0) < ends.clamp(max=start + n_valid).unsqueeze(1)
    return torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill_(~visible, float("-inf"))


class RecordingWindow(Window):
    """A :class:`Window` on an empty state that also records the layout of the state it builds: per slot,
    ``("conv", C_in, kernel - 1)`` or ``("kv", heads, head_dim)`` (one entry per key/value pair)."""

    def __init__(self, chunk: int):
        super().__init__([], 0, 0, chunk)
        self.layout: list[tuple[str, int, int]] = []

    def conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        self.layout.append(("conv", x.shape[1], conv.kernel_size[0] - 1))
        return super().conv(conv, x)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.layout.append(("kv", k.shape[1], k.shape[3]))
        return super().keys_values(k, v)


def estimator_layout(flow: nn.Module) -> list[tuple[str, int, int]]:
    """The per-step state layout of the estimator (see :class:`RecordingWindow`), from a one-frame dry run."""
    est = flow.decoder.estimator
    check_estimator(est)
    p = next(est.parameters())
    c = est.cfg.out_channels
    z = torch.zeros(2, c, 1, device=p.device, dtype=p.dtype)
    win = RecordingWindow(est.cfg.static_chunk_size)
    with torch.inference_mode():
        estimator_increment(est, z, z, torch.zeros(2, device=p.device, dtype=p.dtype),
                            torch.zeros(2, c, device=p.device, dtype=p.dtype), z, win)
    return win.layout
