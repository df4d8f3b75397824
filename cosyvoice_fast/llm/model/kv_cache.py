"""The Qwen2 decoder's static KV cache, gpt-fast style: per-layer buffers of a fixed shape
``(batch, n_kv_heads, max_len, head_dim)`` written at a *position tensor*.

Nothing in the write path depends on Python-side lengths, so a CUDA-graph backend can capture a step that
writes it; rows may be views of a larger pool (one slot per request).
"""

from __future__ import annotations

import torch

from cosyvoice_fast.config.model import QwenConfig


class KVCacheFullError(ValueError):
    """A write would go past the cache's ``max_len``; the message says how many positions were asked for."""


class KVCache:
    """Pre-allocated key/value buffers for every layer of one decoder.

    ``k[layer]`` / ``v[layer]`` have shape ``(batch, n_kv_heads, max_len, head_dim)``.  Slots at positions that
    have not been written hold stale data; attention masks them out by position, so the cache never needs
    clearing between uses.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if max_len < 1:
            raise ValueError(f"KVCache max_len must be >= 1, got {max_len}")
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.batch = batch

    @classmethod
    def for_config(cls, cfg: QwenConfig, max_len: int, batch: int = 1, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> "KVCache":
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def check_room(self, start: int, n: int) -> None:
        """Raise :class:`KVCacheFullError` unless positions ``start .. start+n-1`` fit (host-side check)."""
        if start < 0 or start + n > self.max_len:
            raise KVCacheFullError(
                f"KV cache overflow: writing {n} position(s) at {start} needs max_len >= {start + n}, "
                f"but this cache holds {self.max_len}; allocate a larger cache for longer sequences")

    def update(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` of shape (B, Hkv, T, D) at positions ``pos`` (T,) and return the layer's buffers.

        ``index_copy_`` keeps the write shape-static and device-side, which is what graph capture needs; the
        bounds check is the caller's job (:meth:`check_room`) because reading ``pos`` would force a sync.
        """
        if pos.dim() == 2:
            return self._update_rows(layer, pos, k, v)
        kb, vb = self.k[layer], self.v[layer]
        kb.index_copy_(2, pos, k.to(kb.dtype))
        vb.index_copy_(2, pos, v.to(vb.dtype))
        return kb, vb

    # ---------------------------------------------------------------- per-row positions (batched decoding)

    def row(self, index: int) -> "KVCache":
        """A batch-1 cache that is a *view* of row ``index``: writes through it land in this cache's buffers.

        Lets a batch of independent requests share one (S, Hkv, max_len, D) allocation: each request prefills
        through its row view with the ordinary shared-position path, and a batched step writes all rows at
        once with per-row positions (:meth:`update` with ``pos`` of shape (B, T)).
        """
        if not 0 <= index < self.batch:
            raise IndexError(f"row {index} of a KV cache with batch {self.batch}")
        return self._view(index, index + 1)

    def head(self, n: int) -> "KVCache":
        """A view of rows ``0 .. n-1``: a batched step over the first ``n`` rows touches no other row."""
        if not 1 <= n <= self.batch:
            raise IndexError(f"first {n} rows of a KV cache with batch {self.batch}")
        return self._view(0, n)

    def _view(self, start: int, stop: int) -> "KVCache":
        view = KVCache.__new__(KVCache)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.max_len = self.max_len
        view.batch = stop - start
        return view

    def _update_rows(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b`` of ``k``/``v`` (B, Hkv, T, D) goes to positions ``pos[b]`` (pos: (B, T), B == batch).

        A scatter along the position dimension with a broadcast index: static shapes, no host reads, and each
        row only ever touches its own row of the buffers.  Positions within a row must be distinct.
        """
        kb, vb = self.k[layer], self.v[layer]
        if pos.shape[0] != kb.shape[0]:
            raise ValueError(f"per-row positions for {pos.shape[0]} rows, but the cache has {kb.shape[0]}")
        index = pos[:, None, :, None].expand(k.shape)
        kb.scatter_(2, index, k.to(kb.dtype))
        vb.scatter_(2, index, v.to(vb.dtype))
        return kb, vb
