"""The ``cudagraph`` LLM backend: static KV caches in a slot pool, prefill and decode replayed as CUDA graphs.

Eager decoding of a 24-layer Qwen2 at batch 1 is launch-bound: ~900 small kernels per token, each costing more
CPU time to launch than GPU time to run.  Here every request borrows a *slot* (a pre-allocated KV cache of
``max_len`` positions plus a few static buffers) and each step is one graph replay.

Decode graphs are captured for each *KV bucket* (e.g. 256, 512, 1024, 2048 positions; batched over the
slots, see below): a step attends over the first ``bucket`` cache positions, masked by position, so early
tokens do not pay for a 2048-long attention.  A decode graph computes:
token embedding -> decoder -> fp32 log-probs (+ the step's eos mask) -> softmax -> the nucleus draw (the
stable top-k head, its cut and the draw: one Triton launch where Triton runs, sort-based torch ops elsewhere).
New requests are prefilled together, a few graph replays per burst (:mod:`.llm_prefill`).  The model is called
through its public methods and does not know it is being captured.

Sampling is the eager RAS sampler's, draw for draw (same seed -> same tokens in fp32): the nucleus draw is
graph-side tensor math (:mod:`.nucleus`).  In batched decode steps with CUDA generators (``device_ras``, on
where Triton is) the whole RAS rule runs in the graph too: each row's exponential variates are recomputed from
its generator's seed and offset (:mod:`..kernels.philox`), both the nucleus draw's and the fallback draw's, the
repetition check reads the row's last history tokens, and the host only advances each generator by one draw
(two after a fallback).  A step then costs one replay and one read of the tokens, which the graph writes into
pinned host memory itself (plus an input copy when rows join, leave or come from the host), whatever the row
count and however many rows fall back.  The graph also writes each row's next inputs back into its own input
columns (:mod:`.decode_feed`), so with ``decode_ahead`` (on with device RAS) each call launches the step
after the one it returns before reading anything: the host's per-token work overlaps the GPU's next step.  A
prefill does the same for each row's first decode step (its graph writes that step's inputs), so the GPU goes
from a new request's prefill straight into its first step while the host reads the prefill's tokens.
Otherwise (prefill, no Triton) the variates are drawn eagerly from each request's generator into a static
buffer just before the replay, the repetition check runs on the host and a fallback draw runs eagerly
(:func:`random_sample`, with its own syncs).  A CPU generator falls back to the eager sampler entirely.

Batched decoding.  A decode step is GPU-bound by ~600 small kernels, so stepping 16 requests one after another
costs 16x one step.  Instead all slots share one KV allocation of shape
(slots + 1, Hkv, max_len, D) per layer (each slot's cache is a view of its row; the last row is the spare that
batched prefill's unused rows write to), and one decode graph per (KV bucket, row count) steps rows
``0 .. n-1`` each at its own position (``pos`` (n, 1)); row counts are 1, 2, 4, ... up to S, and a step uses the
smallest that covers its rows.  The engine decides which states take part in a step (:meth:`CudaGraphLLM.decode`);
the backend only executes it.  Per step: a few tiny eager kernels (one exponential draw per row from its own
generator, an input copy), one replay, one ``.tolist()`` of the (S,) tokens.

- Rows below ``n`` that are not in a step (free slots, requests the engine left out of it) still run in the
  graph, at position ``max_len - 1`` with their last inputs.  That is harmless: a row only writes its own cache
  row, and writing at any position >= the row's next write position is overwritten before any query of that
  row can attend to it (each step writes its position before attending, prefill rewrites 0..n-1), while
  ``max_len - 1`` keeps the whole bucket visible so the garbage stays finite (no fully masked softmax).
  Their outputs land in rows nobody reads until that row's next own step rewrites them.
- Determinism: a row's token depends only on its own request.  Each graph has fixed shapes (so fixed
  kernels), matmuls and attention never mix rows, softmax and the nucleus draw are per row, and the
  exponential draw of row i comes from request i's generator, drawn in the same order as unbatched (the RAS
  fallback draw of a step happens right after that step, before the row's next q).  Caveats: (1) the step's
  KV bucket is the one for the largest position among the stepped rows, so a neighbour can lengthen a row's
  attention; masked positions contribute exact zeros, but whether the kernel's reduction order changes with
  the length is kernel-dependent (pass ``kv_buckets=(max_len,)`` for strict independence); (2) batch-n
  matmul kernels may round differently for different n, so tokens equal the eager backend's up to
  near-ties at rounding level (the GPU tests check equality on the tiny fp32 model).

Log-probs differ from eager's only by the attention length (bucket instead of the filled prefix, the rest
masked), a rounding-level difference.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.llm.model.qwen2 import KVCache
from cosyvoice_fast.llm.model.sampling import RasSampler, random_sample
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.llm.stage import LLMState, StepResult, accept_token, new_llm_state
from cosyvoice_fast.llm.decode_feed import Row, StepFeed, int64
from cosyvoice_fast.kernels.graphs import capture
from cosyvoice_fast.llm.kv_pool import SlotPool
from cosyvoice_fast.llm.buckets import bucket_for, choose_kv_buckets, token_budget
from cosyvoice_fast.llm.prefill import PREFILL_TOKENS, BatchedPrefill, PrefillItem, SlotRows
from cosyvoice_fast.llm.nucleus import nucleus_pick_rows, ras_pick_into

log = logging.getLogger(__name__)

_NEG_INF = -float("inf")


# ------------------------------------------------------------------------------------------ pure helpers


def why_unavailable(llm: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``llm`` here, or None when it can."""
    if not torch.cuda.is_available():
        return "llm backend 'cudagraph' needs a CUDA GPU (torch sees none here); choose 'eager' instead"
    dev = next(llm.parameters()).device
    if dev.type != "cuda":
        return f"llm backend 'cudagraph' needs a CUDA GPU, but the model is on {dev}; choose 'eager' instead"
    return None


# ------------------------------------------------------------------------------------------ the backend


@dataclass
class _Slot:
    """One request's static state: its cache and the graphs' per-row inputs and outputs.

    ``cache``, ``bias``, ``q``, ``logp`` and ``token`` are views of row ``index`` of the backend's batched
    buffers, so the batched decode graphs and the batched prefill graphs (which gather and scatter by slot
    index) share them.
    """

    index: int
    cache: KVCache
    bias: torch.Tensor  # (V,) fp32: 0 or -inf (the step's eos/stop mask)
    q: torch.Tensor  # (top_k,) fp32: exponential variates of this step's draw
    logp: torch.Tensor  # (V,) fp32 out: masked log-probs
    token: torch.Tensor  # (1,) int64 out: the nucleus draw
    mask_mode: str = ""


class CudaGraphLLM:
    """Speech-token generation with pooled static KV caches and graph-replayed prefill and decode steps.

    ``slots`` requests can run at once, each with room for ``max_len`` LM positions (prompt + text + tokens);
    ``kv_buckets`` are the attention lengths captured per slot for decoding (see :func:`choose_kv_buckets`).
    ``prefill_buckets`` are the padded input lengths whose prefill is captured too (eager prefill costs one
    kernel launch per op, tens of ms of CPU time at 0.5B); longer inputs prefill eagerly; ``()`` turns it off.
    Each length gets graphs for 1, 2, 4, ... rows while ``rows x length <= prefill_tokens`` (and rows <=
    ``slots``), which bounds the scratch activations of the largest prefill.  ``fused_prefill`` (default:
    whenever the decoder offers one, as the ``fused`` backend's does) runs those graphs on the fused kernels.
    Everything is allocated and captured here, so the first request pays nothing.

    A :meth:`decode` call steps all its states in one graph replay (see the module docstring).
    ``device_ras`` (default: on a GPU where Triton is installed and the sampler is the RAS one) runs
    the repetition-aware sampling inside the batched decode graphs; off, it runs on the host.  ``decode_ahead``
    (needs device RAS; default: on with it) launches each row's next step before returning this one's token.
    A row the engine leaves out of its next call keeps that result for when it returns; only the rows that
    end waste their step ahead (``ahead_rows`` counts the steps launched ahead, ``StepFeed.dropped`` those
    thrown away).
    ``batched_steps`` / ``batched_rows`` count batched decode calls and the request-steps they returned,
    ``replays`` the batched decode graph replays behind them.  Every
    per-request value (slot, position, history, generator, limits) lives on the :class:`LLMState`.
    """

    def __init__(self, llm: torch.nn.Module, config: ModelConfig, *, slots: int = 16, max_len: int = 2048,
                 kv_buckets: Sequence[int] | None = None, prefill_buckets: Sequence[int] = (64, 128, 256, 512),
                 progress: bool = True, prefill_tokens: int = PREFILL_TOKENS,
                 device_ras: bool | None = None, decode_ahead: bool | None = None,
                 fused_prefill: bool | None = None):
        reason = why_unavailable(llm)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.llm = llm
        llm.decoder.fuse_projections()  # q/k/v and gate/up as single GEMMs: same values, fewer kernels per step
        self.config = config
        self.device = next(llm.parameters()).device
        self.sampler = llm.default_sampler()
        self.max_len = max_len
        self.buckets = choose_kv_buckets(max_len, kv_buckets)
        self.fallback_draws = 0  # how often the RAS repetition check replaced a nucleus draw
        self.row_counts = tuple(sorted({min(slots, 2 ** i) for i in range(max(1, slots).bit_length() + 1)}))
        # Graphs share one scratch pool: one replay (and its reads) at a time.  Re-entrant because a generator
        # finalised by the garbage collector inside a locked region of the same thread takes it in its cleanup.
        self._lock = threading.RLock()
        self.batched_steps = 0  # batched decode calls so far
        self.batched_rows = 0  # request-steps they returned (batched_rows / batched_steps = mean batch)
        vocab = llm.cfg.vocab_out
        self._k = min(self.sampler.top_k, vocab)
        if device_ras is None:
            device_ras = self.device.type == "cuda" and self._device_ras_possible(vocab)
        self.device_ras = device_ras
        if self.device_ras and not self._device_ras_possible(vocab):
            raise ValueError("device_ras=True needs the RAS sampler, Triton and a vocabulary of at most 8192 ids")
        if decode_ahead is None:
            decode_ahead = self.device_ras
        if decode_ahead and not self.device_ras:
            raise ValueError("decode_ahead=True needs device_ras: the next step's inputs must come from the graph")
        self.decode_ahead = decode_ahead
        self.replays = 0  # batched decode graph replays (with decode_ahead, one per call plus each call's joiners)
        self.ahead_rows = 0  # request-steps launched ahead of their call
        # imported here, once, not at module level: the plain cudagraph backend must not need Triton
        self._philox = importlib.import_module("..kernels.philox", __package__) if self.device_ras else None
        win = self.sampler.win_size if self.device_ras else 0
        # the eager rule is ``count >= win * tau`` on a whole count: the same as ``count >= ceil(win * tau)``
        self._repeats = math.ceil(win * self.sampler.tau_r) if self.device_ras else 0
        on_cuda = self.device.type == "cuda"
        t0, mem0 = time.perf_counter(), torch.cuda.memory_allocated(self.device) if on_cuda else 0
        with torch.inference_mode():
            dev, f32 = self.device, torch.float32
            self._limit = torch.full((), self.sampler.top_p, dtype=f32, device=dev)
            # batched state: one row per slot (slots hold views of their row) plus the spare row
            self._cache = llm.new_cache(max_len, batch=slots + 1)
            self._bias = torch.zeros(slots + 1, vocab, dtype=f32, device=dev)
            self._q = torch.ones(slots + 1, self._k, dtype=f32, device=dev)
            self._logp = torch.zeros(slots + 1, vocab, dtype=f32, device=dev)
            self._drawn = torch.zeros(2, slots + 1, dtype=torch.long, device=dev)  # tokens; fallback flags
            self._token = self._drawn[0]
            self._q_again = torch.ones(slots, vocab, dtype=f32, device=dev) if self.device_ras else None
            # batched step inputs: with device_ras a column per slot that the graph advances itself (StepFeed);
            # else row 0 = fed tokens, row 1 = positions (idle rows sit at max_len - 1), copied in per step
            self._feed = StepFeed(slots, max_len, win, self._philox.DRAW_OFFSET, dev) if self.device_ras else None
            self.prefiller = BatchedPrefill(
                llm, SlotRows(self._cache, self._bias, self._q, self._logp, self._token, self._limit),
                buckets=[b for b in prefill_buckets if 0 < b <= max_len], slots=slots, max_tokens=prefill_tokens,
                fused=fused_prefill, draw=self._philox.exponential_rows if self.device_ras else None,
                feed=self._feed if self.decode_ahead else None)
            if self._feed is None:
                self._step_in = torch.zeros(2, slots, dtype=torch.long, device=dev)
                self._step_in[1].fill_(max_len - 1)
                self._host_in = torch.zeros(2, slots, dtype=torch.long, pin_memory=on_cuda)
                self._host_np = self._host_in.numpy()
                self._copied = torch.cuda.Event() if on_cuda else None  # the last host -> device input copy
            self._batch_graphs: dict[tuple[int, int], Any] = {}
            self.pool = SlotPool([self._new_slot(i) for i in range(slots)], name="LLM slot")
            n = self._capture_all(progress)
        log.info("cudagraph LLM: %d graphs (batched x kv buckets %s + prefill rows per length %s) captured in %.1f "
                 "s; %.0f MiB for caches and graphs", n, list(self.buckets),
                 self.prefiller.row_counts, time.perf_counter() - t0,
                 ((torch.cuda.memory_allocated(self.device) if on_cuda else 0) - mem0) / 2**20)

    def _device_ras_possible(self, vocab: int) -> bool:
        if not isinstance(self.sampler, RasSampler) or importlib.util.find_spec("triton") is None:
            return False
        from cosyvoice_fast.llm.kernels.philox import MAX_ELEMENTS

        return vocab <= MAX_ELEMENTS

    def _new_slot(self, i: int) -> _Slot:
        return _Slot(index=i, cache=self._cache.row(i), bias=self._bias[i], q=self._q[i], logp=self._logp[i],
                     token=self._token[i:i + 1])

    # -------------------------------------------------------------------------------------- capture

    def _batch_step_math(self, bucket: int, n: int) -> None:
        """What a batched decode graph replays: the first ``n`` slot rows each fed one token at its own position,
        attending over ``bucket`` positions, then the per-row masked nucleus draw.

        Graphs exist for row counts 1, 2, 4, ... up to the slot count: slots are handed out lowest-first, so
        ``n`` active requests usually sit in rows ``0 .. n-1`` and a lone request pays for one row, not all."""
        if self._feed is not None:
            tok, pos, gens, window, live = self._feed.read(n)
        else:
            tok, pos = self._step_in[0, :n].view(-1, 1), self._step_in[1, :n].view(-1, 1)
        logp = self.llm.step_log_probs(tok, pos, self._cache.head(n), kv_len=bucket)
        if self._feed is not None:
            ras_pick_into(logp, self._bias[:n], self._q[:n], self._q_again[:n], window, self._limit, self._repeats,
                          self._logp[:n], self._drawn[:, :n], gens=gens)
            self._feed.advance(n, self._drawn[:, :n], live)
        else:
            logp, token = nucleus_pick_rows(logp, self._bias[:n], self._q[:n], self._limit)
            self._logp[:n].copy_(logp)
            self._token[:n].copy_(token)

    def _graph_jobs(self) -> list[tuple[dict[int, Any], int, Any]]:
        """Every graph to capture: ``(where it goes, its key, the math it replays)``; warm-ups first per kind."""
        jobs = [(self._batch_graphs, (b, n), partial(self._batch_step_math, b, n))
                for b in self.buckets for n in self.row_counts]
        return jobs + self.prefiller.jobs()

    def _capture_all(self, progress: bool) -> int:
        from tqdm.auto import tqdm

        jobs = self._graph_jobs()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: library handles and kernel choices happen outside any capture
            for b in self.buckets:
                for n in self.row_counts:
                    self._batch_step_math(b, n)
            self.prefiller.warm()
        torch.cuda.synchronize(self.device)
        scratch = torch.cuda.graph_pool_handle()
        for where, key, step in tqdm(jobs, desc="capturing LLM graphs", unit="graph", disable=not progress,
                                     leave=False):
            where[key], _ = capture(step, self.device, scratch, warmup=0)  # warmed up above, once per shape
        torch.cuda.synchronize(self.device)
        return len(jobs)

    # -------------------------------------------------------------------------------------- stepping

    @property
    def slots_in_use(self) -> int:
        return self.pool.in_use

    def _set_mask(self, s: _Slot, step: int, min_len: int, ignore_eos: bool) -> None:
        """Mirror eager's per-step masking: all stop ids with ``ignore_eos``, else eos for the first ``min_len``."""
        mode = "stops" if ignore_eos else ("eos" if step < min_len else "none")
        if mode == s.mask_mode:
            return
        cfg = self.llm.cfg
        s.bias.zero_()
        if mode == "stops":
            s.bias[cfg.speech_token_size:] = _NEG_INF
        elif mode == "eos":
            s.bias[cfg.eos_token] = _NEG_INF
        s.mask_mode = mode

    def _take(self, s: _Slot, history: list[int], gen: torch.Generator, token: int,
              fallback: int | None = None) -> int:
        """The step's token on the host, with the RAS repetition rule applied exactly as the eager sampler does.

        ``token``: the graph's nucleus draw, read to the host with its step's other rows.  ``fallback`` (device
        RAS): the graph applied the rule already and says whether it redrew; the generator is advanced past
        the draws it made."""
        if gen.device.type != "cuda":  # a CPU generator draws on the CPU: let the eager sampler do all of it
            return int(self.sampler(s.logp, history, gen))
        if fallback is not None:
            gen.set_offset(gen.get_offset() + self._philox.DRAW_OFFSET * (1 + fallback))
            self.fallback_draws += fallback
            return token
        win, tau = self.sampler.win_size, self.sampler.tau_r
        window = history[-win:] if win > 0 else []
        if window.count(token) >= win * tau:
            banned = s.logp.clone()
            banned[token] = _NEG_INF
            token = random_sample(banned, gen)
            self.fallback_draws += 1
        return token

    def _replay_rows(self, rows: Sequence[LLMState]) -> None:
        """Feed each state's last token at its position and replay the batched graph (bucket: the largest
        position); the host samples afterwards.  Rows not listed sit at ``max_len - 1`` (see the module
        docstring for why that is harmless).  The path without device RAS."""
        if self._copied is not None:  # the pinned buffer is read by an async copy: wait for the last one
            self._copied.synchronize()  # (normally long done: every step syncs on its tokens)
        host = self._host_np
        host[0, :] = 0
        host[1, :] = self.max_len - 1
        slots = [self.pool.item(r.slot) for r in rows]
        for r, s in zip(rows, slots):
            s.cache.check_room(r.pos, 1)
            host[0, s.index] = r.history[-1]
            host[1, s.index] = r.pos
        self._step_in.copy_(self._host_in, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        for r, s in zip(rows, slots):
            self._set_mask(s, r.step, r.min_len, r.ignore_eos)
            if r.generator.device.type == "cuda":  # each row's draw from its own generator, in its own order
                s.q.exponential_(1.0, generator=r.generator)
        self._replay(max(r.pos for r in rows), max(s.index for s in slots))

    def _launch(self, rows: Sequence[LLMState], ahead: bool, prefilled: bool = False) -> None:
        """Replay one device-RAS step for ``rows``: each at its next step whose result is not pending yet.
        ``ahead``: one past the step pending for it, with inputs the graph left on the device; else its next
        step from the host's state (a fresh column).  ``prefilled``: the first decode step of rows whose prefill
        was just launched and whose token is not read yet (the prefill graph wrote their columns).  Its result
        becomes pending (:class:`.decode_feed.StepFeed`)."""
        columns: dict[int, list[int] | None] = {}
        launched, top = [], 0
        for st in rows:
            s = self.pool.item(st.slot)
            step, pos = (st.step + 1, st.pos + 1) if ahead else (st.step + prefilled, st.pos)
            s.cache.check_room(pos, 1)
            self._set_mask(s, step, st.min_len, st.ignore_eos)
            fresh = not (ahead or prefilled)
            columns[s.index] = self._feed.column(st.history[-1], pos, st.generator, st.history) if fresh else None
            launched.append(Row(s.index, st, step, pos))
            top = max(top, pos)
        self._feed.stage(columns)
        self._replay(top, max(columns))
        self._feed.collect(self._drawn, launched)
        self.ahead_rows += len(launched) if ahead or prefilled else 0

    def _launch_first(self, group: Sequence[PrefillItem]) -> None:
        """Between a prefill replay and the read of its tokens: launch the first decode step of each row that
        will take one (its prefill graph wrote the step's inputs), so the GPU goes on from the prefill to that
        step while the host reads, accepts and schedules.  A row whose prefill token ends it (a stop id) drops
        the step when its slot is released.  The inputs assume the prefill's token was drawn with one draw: true
        whenever the repetition threshold is positive (an empty window never repeats)."""
        if any(it.state.generator.device.type != "cuda" for it in group):
            return  # a CPU generator's row is sampled on the host from the prefill's log-probs: keep them
        if self._repeats <= 0:
            return  # a rule that redraws even on an empty window moves the generator twice: the column is wrong
        rows = [it.state for it in group if it.state.max_len > 1 and it.state.pos < self.max_len]
        if not rows:
            return
        try:
            self._launch(rows, ahead=False, prefilled=True)
        except Exception:  # noqa: BLE001 - only a head start: the decode call launches these steps itself
            log.exception("could not launch the first decode step behind a prefill; the decode call launches it")
            for st in rows:
                self._feed.drop(st.slot)

    def _replay(self, top: int, last_slot: int) -> None:
        """Replay the batched decode graph for positions up to ``top`` (its KV bucket) over slot rows
        ``0 .. last_slot`` (the smallest captured row count that covers them)."""
        n = next(c for c in self.row_counts if c > last_slot)
        self._batch_graphs[bucket_for(self.buckets, top), n].replay()
        self.replays += 1

    def _decode_fed(self, states: Sequence[LLMState]) -> list[StepResult]:
        """A device-RAS decode call (caller holds the lock): launch the rows whose step is not pending (new,
        or back after sitting out), then, with ``decode_ahead``, every row's step after, and only then read
        and accept the results of the steps asked for.  The step launched ahead is this call's ``states``'s
        next step: the engine's next call usually asks for it, and finds it computed or computing.  A state with
        ``no_ahead`` set gets none: the engine pauses it after this step, so a step ahead would only take GPU time
        from the chunk that paused it (and its next call launches that step from the host, as after sitting
        out)."""
        feed = self._feed
        try:
            feed.settle()
            fresh = [st for st in states if not feed.pending(st.slot, st, st.step)]
            if fresh:
                self._launch(fresh, ahead=False)
            # a CPU generator's row is sampled on the host from the step's log-probs: nothing may overwrite them
            if self.decode_ahead and all(st.generator.device.type == "cuda" for st in states):
                more = [st for st in states if st.step + 1 < st.max_len and st.pos + 1 < self.max_len
                        and not st.no_ahead]
                if more:
                    self._launch(more, ahead=True)
        except Exception as e:  # noqa: BLE001 - the launch failed as a whole: each row gets the error
            for st in states:
                self.release(st)
            return [e] * len(states)
        return self._accept_rows(states, lambda st, s: feed.take(st.slot, st, st.step))

    def _accept_rows(self, states: Sequence[LLMState],
                     drawn: Callable[[LLMState, _Slot], tuple[int, int | None]]) -> list[StepResult]:
        """Count the decode call and accept each state's step: ``drawn(state, slot)`` gives the graph's token
        and, with device RAS, whether it fell back (else None: the host applies the rule).  Each row in turn,
        so the rule and any fallback draw run before the row's generator draws again; a row's own failure is
        that row's result."""
        self.batched_steps += 1
        self.batched_rows += len(states)
        out: list[StepResult] = []
        for st in states:
            try:
                s = self.pool.item(st.slot)
                token, fallback = drawn(st, s)
                st.pos += 1
                out.append(self._accept(st, self._take(s, st.history, st.generator, token, fallback)))
            except Exception as e:  # noqa: BLE001
                self.release(st)
                out.append(e)
        return out

    def _prefill_draw(self, it: PrefillItem, in_graph: bool) -> None:
        """The nucleus variates of a prefill draw: ``exponential_`` of the request's generator into the slot's
        buffer, or with device RAS the same bits from its seed and offset, drawn by the prefill graph itself
        (``in_graph``: its item carries them) or here; the generator is advanced past them either way."""
        gen, s = it.state.generator, it.slot
        if not self.device_ras:
            s.q.exponential_(1.0, generator=gen)
            return
        offset = gen.get_offset()
        it.draw = (int64(gen.initial_seed()), offset)
        if not in_graph:
            state = torch.tensor([[it.draw[0]], [offset]], dtype=torch.long)
            self._philox.exponential_rows(state.to(self.device, non_blocking=True), s.q.view(1, -1))
        gen.set_offset(offset + self._philox.DRAW_OFFSET)

    def _check_generator(self, gen: torch.Generator) -> None:
        if gen.device.type == "cuda" and (gen.device.index or 0) != (self.device.index or 0):
            raise ValueError(f"the request's generator is on {gen.device} but the LM runs on {self.device}")

    # -------------------------------------------------------------------------------------- public

    #: :meth:`prefill` returns after reading its tokens from the device, so the prefill's GPU work is done by then
    #: (the engine does not synchronise after it: that would also wait for the decode step launched behind it)
    prefill_synced = True

    @property
    def capacity(self) -> int:
        """Slots: states that can hold a KV cache at once."""
        return self.pool.capacity

    def free_slots(self) -> int:
        return self.pool.capacity - self.pool.in_use

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> LLMState:
        """Plain data: no slot is taken until :meth:`prefill`."""
        self._check_generator(generator)
        return new_llm_state(self.llm, inputs, text, generator, max_tokens, ignore_eos)

    def release(self, state: LLMState) -> None:
        """Give ``state``'s slot back (idempotent); a step launched ahead for it is dropped."""
        if state.slot is not None:
            if self._feed is not None:
                self._feed.drop(state.slot)
            self.pool.release(state.slot)
            state.slot = None

    def _accept(self, st: LLMState, token: int) -> int | None:
        tok = accept_token(st, token, self.llm.cfg.speech_token_size)
        if st.done:
            self.release(st)
        return tok

    def prefill(self, states: Sequence[LLMState]) -> list[StepResult]:
        """Take a slot per state, prefill them (batched graph replays per padded input length, eager beyond) and
        draw each first token.  A row's own failure (input too long, ...) is that row's result; a failed replay
        is the result of every row in it.  Raises :class:`~.kv_pool.PoolExhausted` if more states than free
        slots are passed (the engine never does)."""
        out: list[StepResult] = [None] * len(states)
        items: list[PrefillItem] = []
        with torch.inference_mode(), self._lock:
            if self._feed is not None:
                self._feed.settle()
            for i, st in enumerate(states):
                try:
                    st.slot, s = self.pool.acquire()
                    self._set_mask(s, 0, st.min_len, st.ignore_eos)
                    item = PrefillItem(i, st, s, ids=(st.prompt_text, st.text, st.prompt_speech))
                    st.pos = item.length  # the next cache position to write
                    st.max_len = token_budget(st.pos, st.max_len, self.max_len, st.ignore_eos)
                    items.append(item)
                except Exception as e:  # noqa: BLE001 - a row's failure is that row's own
                    self.release(st)
                    out[i] = e
            for padded, group in self.prefiller.groups(items):
                try:
                    for it in group:
                        if it.state.generator.device.type == "cuda":
                            self._prefill_draw(it, in_graph=padded is not None and self.prefiller.draws)
                    first = partial(self._launch_first, group) if self.prefiller.starts_decode else None
                    drawn = self.prefiller.run(padded, group, after=first)
                except Exception as e:  # noqa: BLE001 - the replay failed: each of its rows gets the error
                    for it in group:
                        self.release(it.state)
                        out[it.index] = e
                    continue
                for it, token in zip(group, drawn):
                    st = it.state
                    try:
                        out[it.index] = self._accept(st, self._take(it.slot, st.history, st.generator, token))
                    except Exception as e:  # noqa: BLE001
                        self.release(st)
                        out[it.index] = e
        return out

    def decode(self, states: Sequence[LLMState]) -> list[StepResult]:
        """One decode step for every state, batched: one graph replay for all of them (with ``decode_ahead``,
        usually already launched by the previous call).  If the step itself fails, every row gets the error."""
        if not states:
            return []
        with torch.inference_mode(), self._lock:
            if self._feed is not None:
                return self._decode_fed(states)
            try:
                self._replay_rows(states)
                drawn = self._drawn[0].tolist()  # the one sync per batched step
            except Exception as e:  # noqa: BLE001 - the whole step failed: each row gets the error
                for st in states:
                    self.release(st)
                return [e] * len(states)
            return self._accept_rows(states, lambda st, s: (drawn[s.index], None))

    def teacher_forced_logp(self, lm_input: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """(len(tokens) + 1, V) log-probs: after prefilling ``lm_input``, then after feeding each token through
        the captured graphs (no masking, no sampling effects).  For parity tests and debugging."""
        index, s = self.pool.acquire()
        gen = torch.Generator(device=self.device)
        try:
            with torch.inference_mode(), self._lock:
                if self._feed is not None:
                    self._feed.settle()
                self._set_mask(s, 0, 0, False)
                token_budget(lm_input.shape[1], len(tokens) + 1, self.max_len, True)
                s.q.exponential_(1.0, generator=gen)
                (group,) = self.prefiller.groups([PrefillItem(0, None, s, lm_input=lm_input)])
                self.prefiller.run(*group)
                rows = [s.logp.clone()]
                row = LLMState(text=lm_input, prompt_text=None, prompt_speech=None, generator=gen, min_len=0,
                               max_len=len(tokens) + 1, ignore_eos=False, slot=index)
                for i, tok in enumerate(tokens):
                    row.history.append(int(tok))
                    row.pos = lm_input.shape[1] + i
                    if self._feed is not None:  # the batched graph, this row alone (others not live)
                        self._launch([row], ahead=False)
                        self._feed.take(index, row, row.step)  # only the log-probs are wanted
                    else:  # the batched graph, this row alone (others idle at max_len - 1)
                        self._replay_rows([row])
                    rows.append(s.logp.clone())
            return torch.stack(rows)
        finally:
            self.pool.release(index)
