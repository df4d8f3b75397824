"""The captured DiT's (:class:`~.dit_blas.BlasDiT`) per-Euler-step modulation table its step graphs read, the
weights it packs once, and the key mask as rows.

Every AdaLN vector of the DiT depends only on the flow time, and a streaming solve runs the same 10 times for
every chunk.  So the table holds one row of modulations per Euler step, filled outside any capture; a step
graph gets the step's index as a device scalar and reads its row, never an AdaLN weight.  One module serves one
schedule: its captured graphs hold the table's address, so another schedule needs another module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cosyvoice_fast.flow.kernels.dit_conv import pack_conv_weight


def check_packable(cfg: Any, name: str) -> None:
    """The DiT packs ``[x | mu | spk | cond]`` as equal-width blocks (CosyVoice2's packing kernel)."""
    if not (cfg.mel_dim == cfg.mu_dim == cfg.spk_dim):
        raise ValueError(f"{name} packs x, mu, spks, cond as equal-width blocks; got mel {cfg.mel_dim}, "
                         f"mu {cfg.mu_dim}, spk {cfg.spk_dim}")


def packed_key(est: torch.nn.Module) -> tuple:
    """What a packed copy of ``est``'s weights is valid for: a ``.to()`` of the DiT moves or recasts them."""
    w0 = est.proj_out.weight
    return w0.device, w0.dtype, w0.data_ptr()


def pack_shared(est: torch.nn.Module) -> dict:
    """The packed weights the captured DiT uses: the input projection's columns in the packing kernel's order, each
    block's q/k/v as one matrix, and the two position convs packed for :func:`~.dit_conv.causal_conv_mish`."""
    m = est.cfg.mel_dim
    pos = est.input_embed.conv_pos_embed
    with torch.no_grad():
        proj = est.input_embed.proj.weight
        # eager order [x | cond | mu | spk] -> the packing kernel's [x | mu | spk | cond]
        proj_w = torch.cat((proj[:, :m], proj[:, 2 * m:], proj[:, m:2 * m]), dim=1).contiguous()
        qkv = [(torch.cat((b.attn.to_q.weight, b.attn.to_k.weight, b.attn.to_v.weight)).contiguous(),
                torch.cat((b.attn.to_q.bias, b.attn.to_k.bias, b.attn.to_v.bias)).contiguous())
               for b in est.transformer_blocks]
        convs = [(pack_conv_weight(conv[0].weight, conv[0].groups), conv[0].bias.contiguous())
                 for conv in (pos.conv1, pos.conv2)]
    return {"key": packed_key(est), "proj_w": proj_w, "qkv": qkv, "convs": convs}


def key_rows(mask: Tensor, x: Tensor) -> Tensor:
    """The estimator's (B, 1, T) mask as one key flag per (B·T) row, in ``x``'s dtype (what the attention reads)."""
    b, _, frames = x.shape
    if mask.shape != (b, 1, frames):
        raise ValueError(f"estimator mask must be ({b}, 1, {frames}), got {tuple(mask.shape)}")
    keys = mask.reshape(b * frames)
    return keys if keys.dtype == x.dtype and keys.is_contiguous() else keys.to(x.dtype).contiguous()


class StepTable:
    """Mixin: :meth:`time_table` fills ``packed()["table"]`` (``n_steps`` rows) through
    :meth:`step_modulation` and returns each row's step index; the class sets ``n_steps`` and ``_times``."""

    n_steps: int
    _times: tuple[float, ...] | None

    def packed(self) -> dict:
        raise NotImplementedError

    def step_modulation(self, t: Tensor, packed: dict) -> Tensor:
        """The modulation row of one flow time ``t`` (shape (1,))."""
        raise NotImplementedError

    def time_width(self) -> int:
        """Columns of a :meth:`time_table` row: one, the Euler step's index."""
        return 1

    def time_table(self, ts: Tensor, rows: int) -> Tensor:
        """(n_steps, rows, 1): step ``i``'s index for each row; fills the modulation table for the times ``ts``
        (called by the step graphs outside any capture, once per filling; a host read of ``ts`` is fine)."""
        p = self.packed()
        name = type(self).__name__
        times = tuple(float(v) for v in ts.tolist())
        if len(times) != self.n_steps:
            raise ValueError(f"{name} holds {self.n_steps} Euler steps' modulations, got {len(times)} times")
        if self._times is not None and self._times != times:
            raise ValueError(f"{name} serves one Euler schedule per module (captured graphs read its table); "
                             f"build another {name} for another schedule")
        with torch.no_grad():
            for i in range(self.n_steps):
                p["table"][i].copy_(self.step_modulation(ts[i:i + 1], p))
        self._times = times
        idx = torch.arange(self.n_steps, device=ts.device).to(p["table"].dtype)
        return idx.view(-1, 1, 1).expand(-1, rows, 1)
