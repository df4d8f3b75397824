"""The flow encoder as CUDA graphs over padded token buckets, shared by the graph-captured flow backends.

The encoder is ~12 ms of launch-bound eager work per call at full size and ~1.5 ms as a graph replay, so with
16 requests' chunks due at once, replaying one graph per request would cost more than the batched estimator
step that follows.  Here a call of any mix of requests pads their token rows on the right to a token bucket
and replays ONE graph per (bucket, rows, attention mode) (:meth:`CausalMaskedDiffWithXvec.encode_padded` says
why padding is exact).  Look-ahead length and finalize are runtime inputs (each row's body length), not
graph keys, so a handful of graphs serves every voice length; :meth:`GraphEncoder.capture_all` captures all of
them at start-up and then freezes, so serving a new voice never captures.  Calls outside the buckets or the
memory budget run the model's own eager ``encode`` (counted in ``eager_calls``).

A graph's integer inputs (each row's ids, then its length and body length) are one (rows, bucket + 2) buffer,
so a replay is staged with one host-to-device copy of the chunk's new token ids (on the host already: the
scheduler holds them) and lengths, a device copy of each row's prompt ids and speaker embedding, and the launch.
A first chunk's encoder runs on an otherwise idle GPU, so every launch before it is on the path to first audio;
building the ids on the device (a token copy, the vocabulary fold, a concatenation, a clear, copies per row and
two length copies) cost more host time than the graph's GPU time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: requests per encoder graph: a call of more rows is split, fewer are padded up to the next size
ENCODER_ROWS = (1, 2, 4, 8, 16)

#: one row of an encoder call: its leading ids on the device (1, p) (the prompt's, or all of them), the ids after
#: them on the host (n,) int64, its body length (ids not used as look-ahead) and its speaker embedding (1, E)
_Row = tuple[Tensor, np.ndarray, int, Tensor]


def token_buckets(frame_buckets: Sequence[int] | None, ratio: int, granularity: int, max_tokens: int
                  ) -> tuple[int, ...]:
    """Token lengths to capture: the estimator's frame buckets divided by ``token_mel_ratio`` (a call's
    estimator input is ``ratio`` frames per token, so the two stages pad alike), or every multiple of
    ``granularity`` up to ``max_tokens`` when no buckets are configured."""
    if frame_buckets:
        return tuple(sorted({max(1, f // ratio) for f in frame_buckets}))
    return tuple(range(granularity, max_tokens + 1, granularity))


class GraphEncoder:
    """``flow.encode`` (same call signature) and :meth:`encode_calls` (many requests' chunk calls), served by
    CUDA graphs of :meth:`~cosyvoice_fast.flow.model.flow.CausalMaskedDiffWithXvec.encode_padded`."""

    def __init__(self, flow: torch.nn.Module, device: torch.device, buckets: Sequence[int] | None = None,
                 rows: Sequence[int] = ENCODER_ROWS, max_tokens: int = 1500, max_graphs: int = 256,
                 encode: Callable[..., Any] | None = None):
        """``encode``: the function the graphs capture, with ``flow.encode_padded``'s signature and result (the
        ``fused`` backend's :class:`~cosyvoice_fast.flow.kernels.encoder_fused.FusedEncoder`); default the model's."""
        from cosyvoice_fast.kernels.graphs import GraphCache

        self.flow = flow
        self.encode = encode if encode is not None else flow.encode_padded
        self.device = device
        self.stride = flow.encoder.cfg.upsample_stride
        self.lookahead = flow.encoder.cfg.pre_lookahead_len
        gran = flow.encoder.cfg.static_chunk_size or 25
        self.buckets = token_buckets(buckets, self.stride, gran, max_tokens)
        self.rows = tuple(sorted(set(rows)))
        #: ``rows * (stride * bucket)**2`` of one row at the longest bucket x 2: the attention-memory bound
        self.budget = 2 * (self.stride * self.buckets[-1]) ** 2
        self.caches = {mode: GraphCache(self._fn(mode), device, max_graphs,
                                        f"flow-encoder-{'stream' if mode else 'full'}") for mode in (True, False)}
        self.lock = threading.Lock()
        self.eager_calls = 0  # rows encoded by the eager model (no graph for their shape)
        self.batched_calls = 0  # replays that served more than one request
        self._last_replay: torch.cuda.Event | None = None

    # ------------------------------------------------------------------------------------------ the graphs

    def _fn(self, streaming: bool):
        encode = self.encode

        def run(stage: Tensor, emb: Tensor) -> tuple[Tensor, Tensor]:
            n = stage.shape[1] - 2  # ids, then each row's length and body length (see the module docstring)
            ids, full, body = stage[:, :n].contiguous(), stage[:, n].contiguous(), stage[:, n + 1].contiguous()
            enc = encode(ids, full, body, emb, streaming=streaming)
            return enc.mu, enc.spks

        return run

    @property
    def captures(self) -> int:
        return sum(c.captures for c in self.caches.values())

    @property
    def replays(self) -> int:
        return sum(c.replays for c in self.caches.values())

    def freeze(self) -> None:
        for c in self.caches.values():
            c.freeze()

    def bucket(self, n_tokens: int) -> int | None:
        """The token bucket serving ``n_tokens`` (None: longer than every bucket)."""
        return next((b for b in self.buckets if b >= n_tokens), None)

    def fits(self, rows: int, bucket: int) -> bool:
        return rows * (self.stride * bucket) ** 2 <= self.budget

    def jobs(self) -> list[tuple[int, int, bool]]:
        """Every (bucket, rows, streaming) graph :meth:`capture_all` captures."""
        return [(b, r, s) for b in self.buckets for r in self.rows for s in (True, False) if self.fits(r, b)]

    def _example(self, bucket: int, rows: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
        dev = self.device
        stage = torch.zeros(rows, bucket + 2, dtype=torch.int64, device=dev)
        stage[:, bucket:] = 1  # one token, all of it body
        emb = torch.zeros(rows, self.flow.cfg.spk_embed_dim, device=dev, dtype=dtype)
        emb[:, 0] = 1  # a unit vector: the speaker condition L2-normalises it
        return stage, emb

    def capture_all(self, dtype: torch.dtype, progress: bool = True) -> int:
        """Capture every graph of :meth:`jobs`, then freeze; returns how many."""
        n = self.capture_jobs(self.jobs(), dtype, progress)
        self.freeze()
        return n

    def capture_jobs(self, jobs: Sequence[tuple[int, int, bool]], dtype: torch.dtype, progress: bool = True) -> int:
        """Capture the graphs ``jobs`` (some of :meth:`jobs`, in the order given: the flow stage captures the
        streaming ones, which first chunks need, before the full-attention ones); returns how many."""
        from tqdm.auto import tqdm

        for c in self.caches.values():
            c.max_graphs = max(c.max_graphs, len(self.jobs()))
        for b, r, s in tqdm(jobs, desc="capturing flow-encoder graphs", unit="graph", disable=not progress or not jobs,
                            leave=False):
            with self.lock:
                self.caches[s].get((b, r, dtype), self._example(b, r, dtype))
        return len(jobs)

    def deferred_job(self, job: tuple[int, int, bool], dtype: torch.dtype) -> Any:
        """One graph of :meth:`jobs` as a background job (``kernels.graphs.DeferredCapture``; caches frozen
        meanwhile): captured without the lock, published under it."""
        b, r, s = job
        return self.caches[s].deferred_job("flow-encoder", job, (b, r, dtype), lambda: self._example(b, r, dtype),
                                           lock=self.lock)

    # ---------------------------------------------------------------------------------------------- calls

    def __call__(self, tokens: Tensor, tlen: Tensor, ptok: Tensor, plen: Tensor, emb: Tensor, *,
                 streaming: bool, finalize: bool, n_lookahead: int | None) -> Any:
        """``flow.encode`` for rows of one shape (``tokens`` and ``ptok`` unpadded)."""
        from cosyvoice_fast.flow.model.flow import FlowEncoding

        n_ctx = 0 if finalize else (self.lookahead if n_lookahead is None else max(0, n_lookahead))
        if n_ctx > self.lookahead:  # the model's own message
            return self.flow.encode(tokens, tlen, ptok, plen, emb, streaming=streaming, finalize=finalize,
                                    n_lookahead=n_lookahead)
        ids = torch.cat((ptok.to(tokens.device), tokens), dim=1)
        rows = [(ids[i:i + 1], ids.shape[1] - n_ctx, emb[i:i + 1]) for i in range(ids.shape[0])]
        encs = self.encode_rows(rows, streaming)
        return FlowEncoding(torch.cat([e.mu for e in encs]), torch.cat([e.spks for e in encs]))

    def encode_calls(self, items: Sequence[tuple[Any, Tensor, Any]], streaming: bool) -> list[Any]:
        """Many requests' chunk calls ``(inputs, tokens, call)`` of one attention mode, any lengths: one
        ``FlowEncoding`` each, in order (what ``flow.encode`` gives for that call alone, float rounding)."""
        rows = []
        for inputs, tokens, call in items:
            if not call.finalize and call.lookahead > self.lookahead:
                raise ValueError(f"{call.lookahead} look-ahead tokens asked, the flow model uses at most "
                                 f"{self.lookahead} (lower pre_lookahead_len)")
            ptok = inputs.flow_prompt_speech_token
            # the scheduler's token ids are on the host (a device tensor is read back, once); folded as
            # ``fold_to_flow_vocab`` does (both take the divisor's sign)
            tail = np.remainder(tokens.reshape(-1).cpu().numpy().astype(np.int64), self.flow.cfg.vocab_size)
            n = ptok.shape[1] + tail.shape[0]
            rows.append((ptok, tail, n - (0 if call.finalize else call.lookahead), inputs.embedding))
        return self._encode(rows, streaming)

    def encode_rows(self, rows: Sequence[tuple[Tensor, int, Tensor]], streaming: bool) -> list[Any]:
        """``(ids (1, n), body length, embedding (1, E))`` per row -> one ``FlowEncoding`` per row with ``mu``
        of ``stride * body`` frames.  Rows are grouped by bucket and split to the captured row counts."""
        return self._encode([(ids, np.zeros(0, np.int64), body, emb) for ids, body, emb in rows], streaming)

    def _encode(self, rows: Sequence[_Row], streaming: bool) -> list[Any]:
        """:meth:`encode_rows` of rows whose ids are a device prefix followed by host ids (:data:`_Row`)."""
        from cosyvoice_fast.flow.model.flow import FlowEncoding

        out: list[Any] = [None] * len(rows)
        groups: dict[int | None, list[int]] = {}
        for i, (prefix, tail, _, _) in enumerate(rows):
            groups.setdefault(self.bucket(prefix.shape[1] + tail.shape[0]), []).append(i)
        for bucket, idx in groups.items():
            while idx:
                take = self._rows_for(bucket, len(idx))
                part, idx = idx[:take], idx[take:]
                for i, (mu, spks) in zip(part, self._run(bucket, [rows[i] for i in part], streaming)):
                    out[i] = FlowEncoding(mu, spks)
        return out

    def _rows_for(self, bucket: int | None, n: int) -> int:
        """How many of ``n`` waiting rows one replay takes (all, when they run eagerly)."""
        if bucket is None:
            return n
        fitting = [r for r in self.rows if self.fits(r, bucket)]
        if not fitting:
            return n
        return min(n, fitting[-1])

    def _run(self, bucket: int | None, rows: Sequence[_Row], streaming: bool) -> list[tuple[Tensor, Tensor]]:
        n = len(rows)
        prows = next((r for r in self.rows if r >= n), None)
        dev = rows[0][0].device
        on_gpu = dev.type == "cuda"
        usable = (bucket is not None and prows is not None and self.fits(prows, bucket)
                  and dev.type == self.device.type and not (on_gpu and torch.cuda.is_current_stream_capturing()))
        with self.lock, torch.inference_mode():
            g = None
            if usable:
                dtype = rows[0][3].dtype
                cache = self.caches[bool(streaming)]
                key = (bucket, prows, dtype)
                g = cache.graphs.get(key)
                if g is None:
                    g = cache.get(key, self._example(bucket, prows, dtype))  # None once frozen
                else:
                    cache.graphs.move_to_end(key)
            if g is None:
                return [self._eager(r, streaming) for r in rows]
            if on_gpu and self._last_replay is not None:
                # static buffers are shared: a replay enqueued by another thread/stream must finish first
                torch.cuda.current_stream(dev).wait_event(self._last_replay)
            stage_in, emb_in = g.inputs
            src = [rows[j] if j < n else rows[0] for j in range(prows)]  # padding rows repeat row 0 (no empty rows)
            # pinned: an asynchronous copy (the caching host allocator keeps the block until the copy is done)
            stage = torch.zeros(stage_in.shape, dtype=torch.int64, pin_memory=on_gpu)
            host = stage.numpy()
            for j, (prefix, tail, body, _) in enumerate(src):
                p = prefix.shape[1]
                host[j, p:p + tail.shape[0]] = tail
                host[j, bucket], host[j, bucket + 1] = p + tail.shape[0], body
            stage_in.copy_(stage, non_blocking=True)
            for j, (prefix, _, _, emb) in enumerate(src):  # after the host copy: the prefix goes over its zeros
                if prefix.shape[1]:
                    stage_in[j, :prefix.shape[1]].copy_(prefix[0])
                emb_in[j].copy_(emb[0])
            g.graph.replay()
            self.caches[bool(streaming)].replays += 1
            self.batched_calls += n > 1
            mu, spks = g.outputs
            # outputs live in the graph pool: copy each row out before the next replay
            res = [(mu[j:j + 1, :, :self.stride * rows[j][2]].clone(), spks[j:j + 1].clone()) for j in range(n)]
            if on_gpu:
                self._last_replay = torch.cuda.Event()
                self._last_replay.record(torch.cuda.current_stream(dev))
            return res

    def _eager(self, row: _Row, streaming: bool) -> tuple[Tensor, Tensor]:
        """One row through the model's own ``encode`` (prompt folded into the tokens: the same sequence)."""
        prefix, tail, body, emb = row
        ids = prefix
        if tail.shape[0]:
            ids = torch.cat((prefix, torch.from_numpy(tail).to(prefix.device, prefix.dtype).view(1, -1)), dim=1)
        self.eager_calls += 1
        n = ids.shape[1]
        dev = ids.device
        empty = ids[:, :0]
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        enc = self.flow.encode(ids, torch.tensor([n], dtype=torch.int32, device=dev), empty, zero, emb,
                               streaming=streaming, finalize=body == n, n_lookahead=n - body)
        return enc.mu, enc.spks
