"""The ``cudagraph`` LLM backend: static KV caches in a slot pool, prefill and decode replayed as CUDA graphs.

Eager decoding of a 24-layer Qwen2 at batch 1 is launch-bound: ~900 small kernels per token, each costing more
CPU time to launch than GPU time to run.  Here every request borrows a *slot* (a pre-allocated KV cache of
``max_len`` positions plus a few static buffers) and each step is one graph replay.

Decode graphs are captured for each *KV bucket* (e.g. 256, 512, 1024, 2048 positions; batched over the
slots, see below): a step attends over the first ``bucket`` cache positions, masked by position, so early
tokens do not pay for a 2048-long attention.  A decode graph computes:
token embedding -> decoder -> fp32 log-probs (+ the step's eos mask) -> softmax -> the nucleus draw (the
stable top-k head, its cut and the draw: one Triton launch where Triton runs, sort-based torch ops elsewhere).
New requests are prefilled together, a few graph replays per burst (:mod:`.prefill`).  The model is called
through its public methods and does not know it is being captured.

Sampling is the eager RAS sampler's, draw for draw (same seed -> same tokens in fp32): the nucleus draw is
graph-side tensor math (:mod:`.nucleus`).  In batched decode steps with CUDA generators (``device_ras``, on
where Triton is) the whole RAS rule runs in the graph too, and with ``decode_ahead`` each call launches the
step after the one it returns before reading anything (:mod:`.graph_ahead`).  A step then costs one replay and
one read of the tokens, which the graph writes into pinned host memory itself.  Otherwise (prefill, no Triton)
the variates are drawn eagerly from each request's generator into a static buffer just before the replay, the
repetition check runs on the host and a fallback draw runs eagerly (:mod:`.graph_slots`).  A CPU generator
falls back to the eager sampler entirely.

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
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.llm.model.sampling import RasSampler
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.llm.stage import LLMState, StepResult, accept_token, new_llm_state
from cosyvoice_fast.llm.decode_feed import StepFeed
from cosyvoice_fast.llm.graph_ahead import DecodeAhead
from cosyvoice_fast.llm.graph_capture import GraphCaptures
from cosyvoice_fast.llm.graph_slots import Slot, SlotSteps
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.llm.kv_pool import SlotPool
from cosyvoice_fast.llm.buckets import bucket_for, captured_shape, choose_kv_buckets, token_budget
from cosyvoice_fast.llm.prefill import PREFILL_TOKENS, BatchedPrefill, PrefillItem, SlotRows
from cosyvoice_fast.llm.nucleus import nucleus_pick_rows, ras_pick_into

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ pure helpers


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None when it can."""
    return cuda_missing(device)


def why_unavailable(llm: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``llm`` here, or None when it can."""
    reason = why_unavailable_on(next(llm.parameters()).device)
    return None if reason is None else f"llm backend 'cudagraph' {reason}; choose 'eager' instead"


# ------------------------------------------------------------------------------------------ the backend


class CudaGraphLLM(SlotSteps, DecodeAhead, GraphCaptures):
    """Speech-token generation with pooled static KV caches and graph-replayed prefill and decode steps.

    ``slots`` requests can run at once, each with room for ``max_len`` LM positions (prompt + text + tokens);
    ``kv_buckets`` are the attention lengths captured per slot for decoding (see :func:`choose_kv_buckets`).
    ``prefill_buckets`` are the padded input lengths whose prefill is captured too (eager prefill costs one
    kernel launch per op, tens of ms of CPU time at 0.5B); longer inputs prefill eagerly; ``()`` turns it off.
    Each length gets graphs for 1, 2, 4, ... rows while ``rows x length <= prefill_tokens`` (and rows <=
    ``slots``), which bounds the scratch activations of the largest prefill.  ``fused_prefill`` (default:
    whenever the decoder offers one, as the ``fused`` backend's does) runs those graphs on the fused kernels.
    Everything is allocated and captured here, so the first request pays nothing.  With ``defer_capture`` only
    the graphs ``config.graph_plan.llm_jobs`` marks for before ready are captured here (every shape is still
    warmed up here); the rest are :attr:`deferred` jobs for the engine's background capture thread, and until
    they land a step replays the smallest captured graph that covers it (:func:`~.buckets.captured_shape`).

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
                 fused_prefill: bool | None = None, defer_capture: bool = False):
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
        self._philox = importlib.import_module("cosyvoice_fast.llm.kernels.philox") if self.device_ras else None
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
            n = self._capture_all(progress, defer_capture)
        log.info("cudagraph LLM: %d graphs (batched x kv buckets %s + prefill rows per length %s) captured in %.1f "
                 "s; %.0f MiB for caches and graphs", n, list(self.buckets),
                 self.prefiller.row_counts, time.perf_counter() - t0,
                 ((torch.cuda.memory_allocated(self.device) if on_cuda else 0) - mem0) / 2**20)

    def _device_ras_possible(self, vocab: int) -> bool:
        if not isinstance(self.sampler, RasSampler) or importlib.util.find_spec("triton") is None:
            return False
        from cosyvoice_fast.llm.kernels.philox import MAX_ELEMENTS

        return vocab <= MAX_ELEMENTS

    def _new_slot(self, i: int) -> Slot:
        return Slot(index=i, cache=self._cache.row(i), bias=self._bias[i], q=self._q[i], logp=self._logp[i],
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

    # -------------------------------------------------------------------------------------- stepping

    @property
    def slots_in_use(self) -> int:
        return self.pool.in_use

    def _replay(self, top: int, last_slot: int) -> None:
        """Replay the batched decode graph for positions up to ``top`` (its KV bucket) over slot rows
        ``0 .. last_slot`` (the smallest captured row count that covers them)."""
        key = bucket_for(self.buckets, top), next(c for c in self.row_counts if c > last_slot)
        if key not in self._batch_graphs:  # not captured yet (background): pad up to a captured one
            key = captured_shape(self._batch_graphs.keys(), top + 1, last_slot + 1)
        self._batch_graphs[key].replay()
        self.replays += 1

    def _accept_rows(self, states: Sequence[LLMState],
                     drawn: Callable[[LLMState, Slot], tuple[int, int | None]]) -> list[StepResult]:
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
        tok = accept_token(st, token, self.llm.cfg.first_stop_id)
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
