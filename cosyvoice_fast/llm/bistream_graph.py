"""Bi-streaming steps of several requests in one graph-captured LM forward (the fast path's shape).

A bi-streaming step feeds a *variable number of rows* per request: one speech token most of the time, 5 text
rows after a fill, the whole prompt mix at the start, the text tail + ``task`` when the text ends.  A token-only
batched decode (one row per request) cannot carry that.  Here every request of a step is one row of a batch
whose feed is right-padded to a row bucket (1, 8, 64 by default), each at its own cache positions
(``pos`` (n, R), see :meth:`~cosyvoice_fast.llm.model.qwen2.Qwen2Decoder.forward_rows`), and the log-probs are
read at each request's last real row.  One graph per (KV bucket, request-row count, row bucket) is captured
through :class:`~cosyvoice_fast.kernels.graphs.GraphCache`; feeds longer than the largest row bucket run the
same math eagerly.

Why padding is harmless: padded rows sit at positions after the request's real rows, so causal masking hides
them from the real rows, and every position they write is rewritten (by the step that really reaches it) before
any query can attend to it.  Slots not in a step run at the top of the cache (``max_len - R ..``) for the same
reason.  A step therefore needs ``position + R <= max_len``.

Decisions are made on the host with :func:`~.bistream_eager.decide` (forced fills, the phase's banned ids, the
request's sampler over its history), so tokens equal the eager driver's whenever the log-probs agree to well
within the pick margins (fp32).  This is the shape the engine's batched LLM call needs for bi-streaming; the
serving backends keep their own slots and sampling.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from cosyvoice_fast.llm.model.bistream import BistreamState, StepPlan
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.llm.model.kv_cache import KVCacheFullError
from cosyvoice_fast.kernels import graphs
from cosyvoice_fast.llm.buckets import bucket_for, choose_kv_buckets


class GraphBistream:
    """``slots`` requests with static KV caches of ``max_len`` positions, stepped together.

    ``acquire()`` gives a slot (a request's cache row), ``release(slot)`` returns it; :meth:`step_batch` runs one
    forward for several ``(state, slot)`` pairs and returns each request's log-probs (V,) on the CPU."""

    def __init__(self, llm: Qwen2LM, *, slots: int = 4, max_len: int = 1024, row_buckets: Sequence[int] = (1, 8, 64),
                 kv_buckets: Sequence[int] | None = None, use_graphs: bool | None = None):
        if slots < 1:
            raise ValueError(f"slots={slots}: need at least one")
        self.llm = llm
        self.device = llm.speech_embedding.weight.device
        self.max_len = max_len
        self.row_buckets = tuple(sorted(b for b in set(row_buckets) if 0 < b <= max_len))
        self.kv_buckets = choose_kv_buckets(max_len, kv_buckets)
        self.row_counts = tuple(sorted({min(slots, 2 ** i) for i in range(slots.bit_length() + 1)}))
        self.cache = llm.new_cache(max_len, batch=slots)
        self._free = list(range(slots))
        # without CUDA the same padded batched math runs eagerly (``use_graphs`` defaults to "on a GPU")
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        try:
            self._graphs = {kv: graphs.GraphCache(partial(self._math, kv), self.device, name=f"bistream kv{kv}")
                            for kv in self.kv_buckets} if self.use_graphs else {}
        except RuntimeError as e:
            raise ValueError(f"CUDA graphs need a CUDA device, the LM is on {self.device} ({e}); "
                             "pass use_graphs=False") from None
        self.eager_steps = 0  # steps run without a graph (no graphs, or a feed past the largest row bucket)

    # ------------------------------------------------------------------------------------------ slots

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.cache.batch} bi-streaming slots are in use; release one first")
        self._free.sort()
        return self._free.pop(0)  # lowest first: active requests stay in the first rows

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    # ------------------------------------------------------------------------------------------ math

    def _math(self, kv: int, emb: torch.Tensor, pos: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor]:
        """What a graph replays: rows ``0 .. n-1`` of the cache each fed ``R`` rows at positions ``pos`` (n, R),
        log-probs at row ``last`` of each (n, V)."""
        n = emb.shape[0]
        hidden = self.llm.decoder(emb, pos, self.cache.head(n), kv_len=kv)
        h = hidden.gather(1, last.view(n, 1, 1).expand(n, 1, hidden.shape[-1]))[:, 0]
        return (self.llm.log_probs(h),)

    def step_batch(self, items: Sequence[tuple[BistreamState, int]]) -> list[torch.Tensor]:
        """One forward for every ``(state, slot)`` (each state must have a plan: not waiting, not done)."""
        plans: list[StepPlan] = []
        feeds = []
        for st, _ in items:
            plan = st.next_step()
            if plan is None:
                raise ValueError("a state without a step (waiting for text or done) cannot join a forward")
            plans.append(plan)
            feeds.append(self.llm.embed_segments(plan.segments, st.text_ids, st.prompt_speech, st.out)[0])
        longest = max(f.shape[0] for f in feeds)
        rows = next((b for b in self.row_buckets if b >= longest), longest)
        n = next((c for c in self.row_counts if c > max(slot for _, slot in items)), self.cache.batch)
        emb = torch.zeros(n, rows, feeds[0].shape[-1], dtype=feeds[0].dtype, device=self.device)
        ahead = torch.arange(rows, device=self.device)
        pos = (self.max_len - rows + ahead).repeat(n, 1)
        last = torch.zeros(n, dtype=torch.long, device=self.device)
        for (st, slot), plan, feed in zip(items, plans, feeds):
            if plan.position + rows > self.max_len:
                raise KVCacheFullError(f"a bi-streaming step at position {plan.position} with {rows} padded rows "
                                       f"needs {plan.position + rows} KV positions, a slot holds {self.max_len}")
            emb[slot, :feed.shape[0]] = feed
            pos[slot] = plan.position + ahead
            last[slot] = feed.shape[0] - 1
        kv = bucket_for(self.kv_buckets, max(p.position + rows - 1 for p in plans))
        with torch.inference_mode():
            if self.use_graphs and rows in self.row_buckets:
                args = (emb, pos, last)
                (logp,) = self._graphs[kv].get((n, rows), args).run(*args)
            else:
                self.eager_steps += 1
                (logp,) = self._math(kv, emb, pos, last)
            picked = logp[[slot for _, slot in items]].float().cpu()
        return list(picked)
