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

A request's LM input is gathered inside the graph from its token ids (:meth:`~..models.llm.Qwen2LM.lm_input_rows`)
and, where the runner hands over Philox state (device RAS), its first draw's variates are drawn there too.  So a
replay's host work is a few device-to-device copies of the ids, one copy of the rows' parameters (``_meta``), the
launch and one read of the tokens, instead of ~10 eager ops building each LM input and a copy and a launch per
draw (a lone request's GPU is idle for whatever host time comes before its prefill).  Rows given as
embeddings (teacher forcing) still work: their rows are copied in and marked.

The runner owns the per-slot buffers (KV cache rows, eos mask, exponential variates, log-probs, tokens) and the
generators (it advances each past the graph's draw, or draws on the host when the graph does not); this module
only executes.  A row's values depend only on its own input (shared causal mask, row-wise matmuls), up to the
rounding of the batched kernels, so tokens equal a batch-1 prefill's up to near-ties at rounding level.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.buckets import prefill_row_counts
from cosyvoice_fast.llm.nucleus import nucleus_pick, nucleus_pick_rows

#: most positions (rows x padded length) one batched prefill replay takes: 16 requests of <= 256 positions
PREFILL_TOKENS = 4096

#: rows of ``BatchedPrefill._meta``, one column per replay row: its last real position, its slot, its text ids'
#: count, 1 if its LM input was given as embeddings, and its first draw's Philox seed and offset
LAST, SLOT, TEXT, GIVEN, SEED, OFFSET = range(6)


@dataclass
class PrefillItem:
    """One request of a prefill call: where its result goes, its slot (``index``, ``cache``, ``bias``, ``q``,
    ``logp``, ``token`` views of the runner's rows) and its LM input: ``ids`` (prompt text, text, prompt speech
    token ids, each a tensor or None, as :meth:`~..models.llm.Qwen2LM.build_lm_input` takes them) or
    ``lm_input`` (1, L, H) embeddings.  ``draw``: the Philox (seed, offset) of its first draw, for a prefill
    whose graph draws (the runner advanced the generator past it)."""

    index: int
    state: Any
    slot: Any
    lm_input: torch.Tensor | None = None
    ids: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
    draw: tuple[int, int] = (0, 0)

    @property
    def length(self) -> int:
        """Positions of its LM input."""
        if self.lm_input is not None:
            return int(self.lm_input.shape[1])
        prompt_text, text, speech = self.ids
        return Qwen2LM.lm_input_length(text, prompt_text, speech)

    def embeddings(self, llm: Any) -> torch.Tensor:
        """The LM input as (1, L, H) embeddings (the eager prefill's)."""
        if self.lm_input is not None:
            return self.lm_input
        prompt_text, text, speech = self.ids
        return llm.build_lm_input(text, prompt_text, speech)


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

    ``fused``: run the decoder's fused prefill (default: whenever the decoder has one).  ``draw``: a function
    ``draw(state (2, R) int64 seeds and offsets, out (R, k) fp32)`` that fills each row's exponential variates
    (:func:`..kernels.philox.exponential_rows`); given, the graphs draw every row's first-token variates from
    its item's ``draw``, else they read what the runner put in the slot's ``q`` row.  ``feed``: the runner's
    :class:`~.decode_feed.StepFeed` (with ``draw``); the graphs then also write each row's first decode step into
    its column (:meth:`~.decode_feed.StepFeed.begin`), so the runner can launch that step before it reads the
    prefill's tokens (:meth:`run`'s ``after``).  ``calls`` / ``rows_done`` count replays and the requests they
    carried.  Not thread-safe: the runner's lock serialises it with the decode graphs (they share one graph
    memory pool)."""

    def __init__(self, llm: Any, rows: SlotRows, *, buckets: Sequence[int], slots: int, max_tokens: int,
                 fused: bool | None = None, draw: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                 feed: Any = None):
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
        self._ids = torch.zeros(rows_in, n_in, dtype=torch.int32, device=dev)
        self._pos = torch.arange(n_in, device=dev)
        self._row = torch.arange(rows_in, device=dev)
        self._meta = torch.zeros(OFFSET + 1, rows_in, dtype=torch.long, device=dev)
        self._meta[SLOT].fill_(self.spare)
        # staged on the host and copied in one go (pinned: an asynchronous copy; reused only after the read of
        # the tokens that ends each run, so the copy is done by then)
        self._meta_host = torch.zeros_like(self._meta, device="cpu", pin_memory=dev.type == "cuda")
        self._meta_np = self._meta_host.numpy()
        if feed is not None and draw is None:
            raise ValueError("a prefill that starts the decode steps (feed) must draw its variates (draw)")
        self.draws = draw is not None
        self._draw = draw
        self._feed = feed
        self.starts_decode = feed is not None  # the graphs write each row's first decode step (see ``feed``)
        self._tokens_host = torch.zeros_like(rows.token, device="cpu", pin_memory=dev.type == "cuda")
        self._read = torch.cuda.Event() if dev.type == "cuda" else None
        self._q = (torch.ones(rows_in, rows.q.shape[1], dtype=rows.q.dtype, device=dev) if draw is not None
                   else None)
        # a decoder with its own fused prefill writes straight into the slot rows: no scratch cache to copy from
        can_fuse = callable(getattr(llm.decoder, "prefill_rows", None))
        if fused and not can_fuse:
            raise ValueError("fused prefill needs a decoder with prefill_rows (the 'fused' LLM backend's)")
        self._fused = can_fuse if fused is None else fused
        self._cache = llm.new_cache(n_in, batch=rows_in) if self.buckets and not self._fused else None

    def _math(self, n: int, rows: int) -> None:
        """What a graph replays: ``rows`` LM inputs of up to ``n`` positions (gathered from ``_ids``, or the given
        ``_emb`` rows) through the decoder, then each row's masked log-probs and draw into its slot's rows
        (``_meta[SLOT]``; with ``draw``, its variates too).  Keys/values go through the scratch cache and are
        copied into the slot rows afterwards, or with the fused prefill straight into the slot rows."""
        r, m = self.rows, self._meta
        dst = m[SLOT, :rows]
        x = torch.where(m[GIVEN, :rows, None, None].bool(), self._emb[:rows, :n],
                        self.llm.lm_input_rows(self._ids[:rows, :n], m[TEXT, :rows]))
        if self._fused:  # (rows, H) at each row's last real position; keys/values already in the slot rows
            last = self.llm.decoder.prefill_rows(x, dst, m[LAST, :rows], r.cache)
        else:
            hidden = self.llm.decoder(x, self._pos[:n], self._cache.head(rows), kv_len=n)
            last = hidden[self._row[:rows], m[LAST, :rows]]  # (rows, H): each row's last real position
        if self._draw is not None:
            q = self._draw(m[SEED:OFFSET + 1, :rows], self._q[:rows])
            r.q.index_copy_(0, dst, q)
        else:
            q = r.q.index_select(0, dst)
        logp, token = nucleus_pick_rows(self.llm.log_probs(last), r.bias.index_select(0, dst), q, r.limit)
        r.logp.index_copy_(0, dst, logp)
        r.token.index_copy_(0, dst, token)
        if self._feed is not None:
            self._feed.begin(dst, token, m[LAST, :rows], m[SEED, :rows], m[OFFSET, :rows])
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
        pending = sorted(items, key=lambda it: it.length, reverse=True)
        out: list[tuple[int | None, list[PrefillItem]]] = []
        while pending:
            n = pending[0].length
            padded = next((b for b in self.buckets if b >= n), None)
            take = 1 if padded is None else self.row_counts[padded][-1]
            out.append((padded, pending[:take]))
            pending = pending[take:]
        return out

    def run(self, padded: int | None, group: list[PrefillItem], after: Callable[[], None] | None = None
            ) -> list[int]:
        """Prefill ``group`` (slots taken, masks set; variates drawn into the slot rows, or each item's ``draw``
        set when the graph draws) and return each row's draw read on the host.  ``padded`` None: the eager
        prefill, whose variates always come from the slot row.  ``after``: called once the replay is launched
        and before its tokens are read (only for a replay, not the eager prefill): work it queues on the stream
        runs right after the prefill's, without waiting for the host's read."""
        if padded is None:  # longer than any captured length: the eager prefill, exactly as the eager backend
            (it,) = group
            s = it.slot
            logp, token = nucleus_pick(self.llm.prefill(it.embeddings(self.llm), s.cache)[0], s.bias, s.q,
                                       self.rows.limit)
            s.logp.copy_(logp)
            s.token.copy_(token)
            return [int(token.item())]
        # the smallest row count captured so far (the background thread adds the middle ones after ready; the
        # largest is always there): unused rows write only the spare slot row
        rows = next(r for r in self.row_counts[padded] if r >= len(group) and (padded, r) in self.graphs)
        meta = self._meta_np
        meta[:] = 0
        meta[SLOT] = self.spare
        for j, it in enumerate(group):
            meta[LAST, j], meta[SLOT, j] = it.length - 1, it.slot.index
            meta[SEED, j], meta[OFFSET, j] = it.draw
            if it.lm_input is not None:
                self._emb[j, :it.length].copy_(it.lm_input[0])
                meta[GIVEN, j] = 1
            else:
                meta[TEXT, j] = self._put_ids(j, it.ids)
        self._meta.copy_(self._meta_host, non_blocking=True)
        self.graphs[padded, rows].replay()
        self.calls += 1
        self.rows_done += len(group)
        if after is None:
            drawn = self.rows.token.tolist()  # the one sync of the replay
        else:  # read the tokens as of the replay, whatever ``after`` queues behind it
            self._tokens_host.copy_(self.rows.token, non_blocking=True)
            if self._read is not None:
                self._read.record()
            after()
            if self._read is not None:
                self._read.synchronize()
            drawn = self._tokens_host.tolist()
        return [drawn[it.slot.index] for it in group]

    def _put_ids(self, j: int, ids: tuple[torch.Tensor | None, ...]) -> int:
        """Copy a prompt's ids into row ``j`` of the id buffer in the LM input's layout (position 0 and the task
        position are left as they are: the graph puts fixed rows there); returns the text ids' count."""
        prompt_text, text, speech = (None if t is None else t.reshape(-1) for t in ids)
        col = 1
        for t in (prompt_text, text):
            if t is not None and t.numel():
                self._ids[j, col:col + t.numel()].copy_(t, non_blocking=True)
                col += t.numel()
        if speech is not None and speech.numel():
            self._ids[j, col + 1:col + 1 + speech.numel()].copy_(speech, non_blocking=True)
        return col - 1
