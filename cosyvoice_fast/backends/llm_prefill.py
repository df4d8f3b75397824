"""Batched prefill for the graph-replayed LLM runners: several new requests' prompts in one graph replay.

New requests arrive in bursts (a page of listeners, a benchmark's first wave), and a prefill at batch 1 leaves
the GPU mostly idle: 16 requests prefilled one after another cost 16 replays of a graph that is launch- and
latency-bound at these sizes.  :class:`BatchedPrefill` captures one graph per (padded input length, row count)
instead.  Each request's LM input sits in its own row of a scratch batch, zero-padded after its real positions
(causal masking keeps the padding out of them), and runs through a scratch KV cache; the graph then copies every
row's keys/values, its masked log-probs and its first draw into the rows of the slot it was given.  Slots are an
index tensor, not a shape, so one graph serves any slots; rows a call leaves empty point at a spare cache row
that no slot owns.  Inputs longer than every captured length run the eager SDPA prefill, one at a time.  A
decoder with a fused prefill (the ``fused`` backend's, :mod:`..kernels.qwen2_hybrid`) skips the scratch cache:
it writes each row's keys/values straight into its slot row, nine launches per layer instead of ~25.

The runner owns the per-slot buffers (KV cache rows, eos mask, exponential variates, log-probs, tokens) and
draws each request's variates from its own generator before :meth:`BatchedPrefill.run`; this module only
executes.  A row's values depend only on its own input (shared causal mask, row-wise matmuls), up to the
rounding of the batched kernels, so tokens equal a batch-1 prefill's up to near-ties at rounding level.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from ..models.qwen2 import KVCache
from .llm_buckets import prefill_row_counts
from .nucleus import nucleus_pick, nucleus_pick_rows

#: most positions (rows x padded length) one batched prefill replay takes: 16 requests of <= 256 positions
PREFILL_TOKENS = 4096


@dataclass
class PrefillItem:
    """One request of a prefill call: where its result goes, its slot (``index``, ``cache``, ``bias``, ``q``,
    ``logp``, ``token`` views of the runner's rows) and its LM input (1, L, H)."""

    index: int
    state: Any
    slot: Any
    lm_input: torch.Tensor


@dataclass
class SlotRows:
    """The runner's per-slot buffers a prefill writes into (row ``i`` belongs to slot ``i``; the last row of
    each is the spare) and the nucleus limit."""

    cache: KVCache
    bias: torch.Tensor
    q: torch.Tensor
    logp: torch.Tensor
    token: torch.Tensor
    limit: torch.Tensor


class BatchedPrefill:
    """Prefill graphs for ``buckets`` (padded input lengths), each for 1, 2, 4, ... rows within
    ``max_tokens`` positions (:func:`~.llm_buckets.prefill_row_counts`) and ``slots``.

    ``fused``: run the decoder's fused prefill (default: whenever the decoder has one).  ``calls`` /
    ``rows_done`` count replays and the requests they carried.  Not thread-safe: the runner's lock
    serialises it with the decode graphs (they share one graph memory pool)."""

    def __init__(self, llm: Any, rows: SlotRows, *, buckets: Sequence[int], slots: int, max_tokens: int,
                 fused: bool | None = None):
        self.llm = llm
        self.rows = rows
        self.buckets = tuple(sorted(set(buckets)))
        self.row_counts = {n: prefill_row_counts(slots, n, max_tokens) for n in self.buckets}
        self.spare = slots
        self.calls = 0
        self.rows_done = 0
        self.graphs: dict[tuple[int, int], Any] = {}
        dev = rows.token.device
        n_in = max(self.buckets, default=1)
        rows_in = max((max(r) for r in self.row_counts.values()), default=1)
        self._emb = torch.zeros(rows_in, n_in, llm.cfg.llm_input_size, dtype=llm.speech_embedding.weight.dtype,
                                device=dev)
        self._pos = torch.arange(n_in, device=dev)
        self._row = torch.arange(rows_in, device=dev)
        self._index = torch.zeros(2, rows_in, dtype=torch.long, device=dev)  # last real position, slot
        self._index[1].fill_(self.spare)
        # a decoder with its own fused prefill writes straight into the slot rows: no scratch cache to copy from
        can_fuse = callable(getattr(llm.decoder, "prefill_rows", None))
        if fused and not can_fuse:
            raise ValueError("fused prefill needs a decoder with prefill_rows (the 'fused' LLM backend's)")
        self._fused = can_fuse if fused is None else fused
        self._cache = llm.new_cache(n_in, batch=rows_in) if self.buckets and not self._fused else None

    def _math(self, n: int, rows: int) -> None:
        """What a graph replays: ``rows`` inputs of up to ``n`` positions through the decoder, then each row's
        masked log-probs and draw into its slot's rows (``_index[1]``).  Keys/values go through the scratch cache
        and are copied into the slot rows afterwards, or with the fused prefill straight into the slot rows."""
        r = self.rows
        dst = self._index[1, :rows]
        if self._fused:  # (rows, H) at each row's last real position; keys/values already in the slot rows
            last = self.llm.decoder.prefill_rows(self._emb[:rows, :n], dst, self._index[0, :rows], r.cache)
        else:
            hidden = self.llm.decoder(self._emb[:rows, :n], self._pos[:n], self._cache.head(rows), kv_len=n)
            last = hidden[self._row[:rows], self._index[0, :rows]]  # (rows, H): each row's last real position
        logp, token = nucleus_pick_rows(self.llm.log_probs(last), r.bias.index_select(0, dst),
                                        r.q.index_select(0, dst), r.limit)
        r.logp.index_copy_(0, dst, logp)
        r.token.index_copy_(0, dst, token)
        if not self._fused:
            for src, out in zip(self._cache.k + self._cache.v, r.cache.k + r.cache.v):
                out[:, :, :n].index_copy_(0, dst, src[:rows, :, :n])

    def jobs(self) -> list[tuple[dict, tuple[int, int], Callable[[], None]]]:
        """Every graph to capture: ``(where it goes, its key, the math it replays)``."""
        return [(self.graphs, (n, r), partial(self._math, n, r)) for n in self.buckets for r in self.row_counts[n]]

    def warm(self) -> None:
        """Run every captured shape once (kernel choices and library handles happen before any capture).  Rows
        point at the spare slot row, so no slot is touched."""
        for _, (n, r), math in self.jobs():
            math()

    def groups(self, items: Sequence[PrefillItem]) -> list[tuple[int | None, list[PrefillItem]]]:
        """Split prefills into replays: longest first, each taking as many of the next ones as its padded length
        allows rows (shorter inputs ride along, padded to it, instead of costing a replay of their own).  ``None``
        as the length: longer than every captured length, one eager prefill each."""
        pending = sorted(items, key=lambda it: it.lm_input.shape[1], reverse=True)
        out: list[tuple[int | None, list[PrefillItem]]] = []
        while pending:
            n = pending[0].lm_input.shape[1]
            padded = next((b for b in self.buckets if b >= n), None)
            take = 1 if padded is None else self.row_counts[padded][-1]
            out.append((padded, pending[:take]))
            pending = pending[take:]
        return out

    def run(self, padded: int | None, group: list[PrefillItem]) -> list[int]:
        """Prefill ``group`` (slots taken, masks set, variates drawn) and return each row's draw read on the
        host."""
        if padded is None:  # longer than any captured length: the eager prefill, exactly as the eager backend
            (it,) = group
            s = it.slot
            logp, token = nucleus_pick(self.llm.prefill(it.lm_input, s.cache)[0], s.bias, s.q, self.rows.limit)
            s.logp.copy_(logp)
            s.token.copy_(token)
            return [int(token.item())]
        rows = next(r for r in self.row_counts[padded] if r >= len(group))
        index = torch.tensor([[0] * rows, [self.spare] * rows], dtype=torch.long)
        self._emb[:rows, :padded].zero_()
        for j, it in enumerate(group):
            n = it.lm_input.shape[1]
            self._emb[j, :n].copy_(it.lm_input[0])
            index[0, j], index[1, j] = n - 1, it.slot.index
        self._index[:, :rows].copy_(index)
        self.graphs[padded, rows].replay()
        self.calls += 1
        self.rows_done += len(group)
        drawn = self.rows.token.tolist()  # the one sync of the replay
        return [drawn[it.slot.index] for it in group]
