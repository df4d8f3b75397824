"""Bi-streaming on the eager LM: the reference that batched backends are checked against.

:class:`~cosyvoice_fast.llm.model.bistream.BistreamState` decides what to feed; this module feeds it through the
eager :class:`~cosyvoice_fast.llm.model.speech_lm.Qwen2LM` with the request's own KV cache and decides each token.  A
step may feed several rows at once (text rows, prompt speech, ``task``) and attends to the whole cache, which
is exactly ``Qwen2LM.prefill`` at the current cache length.  The cache grows on demand because a bi-streamed
text has no length known in advance.

Sampling: upstream's repetition-aware sampler by default (:class:`~cosyvoice_fast.llm.model.sampling.RasSampler`)
over the schedule's history (speech tokens *and* fills, as upstream), or any :class:`Sampler`, e.g.
:func:`~cosyvoice_fast.llm.model.sampling.greedy_sample` for the parity fixture's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from cosyvoice_fast.llm.model.bistream import BistreamSpec, BistreamState, StepPlan
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.sampling import Sampler


def bistream_spec(llm: Qwen2LM) -> BistreamSpec:
    """The schedule constants of ``llm`` (5 text rows interleaved with 15 speech rows), its ids from the config."""
    c = llm.cfg
    s = c.speech_token_size
    return BistreamSpec(speech_token_size=s, eos_offset=c.eos_token - s, fill_offset=c.fill_id - s,
                        extra_rows=c.vocab_out - s, endofprompt_id=c.endofprompt_id)


def masked(logp: torch.Tensor, banned: Sequence[int]) -> torch.Tensor:
    """A copy of ``logp`` (V,) with ``banned`` ids at -inf."""
    out = logp.clone()
    if banned:
        out[list(banned)] = -float("inf")
    return out


def decide(plan: StepPlan, logp: torch.Tensor, history: Sequence[int], sampler: Sampler,
           generator: torch.Generator) -> int:
    """The token of one step: the forced one, else the sampler's pick with the phase's banned ids masked."""
    if plan.forced is not None:
        return plan.forced
    return int(sampler(masked(logp, plan.banned), history, generator))


def ensure_room(llm: Qwen2LM, cache: KVCache | None, needed: int, chunk: int = 256) -> KVCache:
    """``cache`` if it holds ``needed`` positions, else a larger one (rounded up to ``chunk``) with its
    contents copied: a bi-streamed request's length is unknown until its text ends."""
    if cache is not None and needed <= cache.max_len:
        return cache
    size = -(-max(needed, 2 * (cache.max_len if cache else 0)) // chunk) * chunk
    grown = llm.new_cache(size)
    if cache is not None:
        for dst, src in zip(grown.k + grown.v, cache.k + cache.v):
            dst[:, :, :cache.max_len].copy_(src)
    return grown


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did: its plan, the log-probs after its rows (V,), the decided token, what was yielded."""

    plan: StepPlan
    logp: torch.Tensor
    token: int
    yielded: int | None


class EagerBistream:
    """Runs :class:`BistreamState` steps on the eager LM.

    Two ways to hold the KV cache: :meth:`step` / :meth:`forward` take it from the caller and hand back the
    (possibly grown) cache; :meth:`acquire` / :meth:`step_batch` / :meth:`release` keep one per slot, the same
    calls :class:`~.bistream_graph.GraphBistream` offers, so an engine drives either runner alike."""

    def __init__(self, llm: Qwen2LM, sampler: Sampler | None = None):
        self.llm = llm
        self.spec = bistream_spec(llm)
        self.sampler = sampler if sampler is not None else llm.default_sampler()
        self._caches: dict[int, KVCache | None] = {}
        self._next_slot = 0

    def acquire(self) -> int:
        """A slot for one request's cache (unbounded: the eager cache grows per request)."""
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._caches[slot] = None
        return slot

    def release(self, slot: int) -> None:
        self._caches.pop(slot, None)

    def step_batch(self, items: Sequence[tuple[BistreamState, int]]) -> list[torch.Tensor]:
        """One forward per ``(state, slot)`` (a loop: eager gains nothing from batching on CPU); each state's
        log-probs (V,).  The caller decides the tokens (:func:`decide`) and calls ``state.accept``."""
        out = []
        for st, slot in items:
            plan = st.next_step()
            if plan is None:
                raise ValueError("a state without a step (waiting for text or done) cannot join a forward")
            logp, self._caches[slot] = self.forward(st, plan, self._caches[slot])
            out.append(logp)
        return out

    def new_state(self, prompt_text: Sequence[int] | torch.Tensor, prompt_speech: Sequence[int] | torch.Tensor,
                  max_tokens: int | None = None, max_token_text_ratio: float | None = None) -> BistreamState:
        """A request's schedule; ``max_token_text_ratio`` (e.g. the model's ``max_token_text_ratio``, 20) caps a
        final phase that never picks eos, see :class:`BistreamState`."""
        return BistreamState(self.spec, _ids(prompt_text), _ids(prompt_speech), max_tokens=max_tokens,
                             max_token_text_ratio=max_token_text_ratio)

    def forward(self, state: BistreamState, plan: StepPlan, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Feed ``plan``'s rows at their positions; (log-probs (V,) after the last row, the cache)."""
        with torch.inference_mode():
            rows = self.llm.embed_segments(plan.segments, state.text_ids, state.prompt_speech, state.out)
            cache = ensure_room(self.llm, cache, plan.position + rows.shape[1])
            return self.llm.prefill(rows, cache, start=plan.position)[0], cache

    def step(self, state: BistreamState, cache: KVCache | None, generator: torch.Generator,
             sampler: Sampler | None = None) -> tuple[StepRecord | None, KVCache | None]:
        """One forward and decision if the state can step (else ``None``); returns the (possibly grown) cache."""
        plan = state.next_step()
        if plan is None:
            return None, cache
        logp, cache = self.forward(state, plan, cache)
        token = decide(plan, logp, state.out, sampler or self.sampler, generator)
        return StepRecord(plan, logp, token, state.accept(token)), cache

    def tokens(self, prompt_text: Sequence[int] | torch.Tensor, prompt_speech: Sequence[int] | torch.Tensor,
               chunks: Iterable[Sequence[int] | torch.Tensor], generator: torch.Generator,
               max_tokens: int | None = None, sampler: Sampler | None = None) -> Iterator[int]:
        """Speech tokens of a text given as an iterable of id chunks, pulled as the schedule needs them (like
        upstream's generator argument).  Closing the iterator ends the request and frees its cache."""
        state = self.new_state(prompt_text, prompt_speech, max_tokens)
        source = iter(chunks)
        cache: KVCache | None = None
        while not state.done:
            if state.waiting:
                chunk = next(source, None)
                if chunk is None:
                    state.end_text()
                else:
                    ids = _ids(chunk)
                    if ids:
                        state.push_text(ids)
                continue
            record, cache = self.step(state, cache, generator, sampler)
            if record is not None and record.yielded is not None:
                yield record.yielded


def _ids(x: Sequence[int] | torch.Tensor) -> list[int]:
    return [int(i) for i in (x.reshape(-1).tolist() if isinstance(x, torch.Tensor) else x)]
