"""The scheduling policy: which requests the workers run next, as a pure function of a snapshot.

The scheduler's workers (:mod:`~cosyvoice_fast.engine.scheduler`) own threads, locks, CUDA streams and stage
objects; this module owns none of them.  A worker copies what the decisions need out of its requests into a
:class:`Snapshot` of plain :class:`RequestView` rows, asks :func:`plan` and executes the batches it gets back
(indices into the snapshot's rows).  So the rules (which requests share a prefill or decode call, how many a
free-slot count lets in, which LM pauses for someone's first audio, which chunks go out together and in what
order) read in one place and are tested without threads or a model (``tests/test_policy.py``).

The rules:

- **prefill**: every request in :attr:`Phase.PREFILL`, oldest first, one call per LLM stage, at most that stage's
  free slots (``None``: unbounded); the rest wait for a slot, they do not fail;
- **decode**: every request in :attr:`Phase.DECODING` whose LM is ready (a bi-streaming LM waiting for text is
  not) and that does not :func:`yield <yields>`, one call per LLM stage;
- **chunks**: every request with a chunk call ready, first chunks first (first audio must not pay for a later
  chunk's long solve), then later chunks by earliest playback deadline, in slices of at most the largest
  captured solve, so each slice's audio goes out before the next is solved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from cosyvoice_fast.engine.state import Phase


@dataclass(frozen=True)
class Limits:
    """The engine's fixed capacities and switches the policy reads (from :class:`EngineConfig`)."""

    max_streams: int  #: requests running at once
    largest_solve: int  #: requests in one chunk batch (``max(EngineConfig.flow_rows)``)
    overlap: bool = False  #: LLM and chunk sides in their own threads (``cuda_streams == 2``)
    first_chunk_priority: bool = True  #: pause LMs past their first chunk while a first chunk is solved


@dataclass(slots=True)
class RequestView:
    """One running request as the policy sees it: plain values copied from its state (defaults: not known or
    not relevant to the question asked)."""

    phase: Phase = Phase.OPENING
    llm: int = 0  #: identity of its LLM stage: requests with equal ``llm`` share prefill/decode calls
    cancelled: bool = False
    llm_ready: bool = False  #: its LM state exists and can be stepped now
    pending: bool = False  #: a chunk call of its segment is ready
    emitted: int = 0  #: chunks sent to its consumer
    busy: bool = False  #: the chunk side is computing one of its chunks
    stream: bool = True  #: a streamed request (a whole-utterance one has no first chunk to hurry)
    tokens_short: int | None = None  #: tokens until its first chunk call is due (``None``: not asked)
    deadline: float = 0.0  #: when its listener can run out of audio (``perf_counter`` seconds)


@dataclass(frozen=True)
class Snapshot:
    """Everything :func:`plan` decides on, taken at one moment."""

    requests: Sequence[RequestView]  #: the running requests, oldest first
    waiting: int = 0  #: requests in the admission queue
    releases: bool = False  #: LM slots of requests ended on the chunk side wait to be given back
    free_slots: Mapping[int, int | None] = field(default_factory=dict)  #: per LLM stage (``None``: unbounded)
    first_busy: bool = False  #: the chunk side is computing a batch with a first chunk in it


@dataclass(frozen=True)
class ChunkBatch:
    """Requests whose next chunk calls go out together (the executor shares one solve per flow stage)."""

    rows: tuple[int, ...]
    first: bool  #: first chunks (while it runs, LMs past their first chunk may pause: :func:`yields`)


@dataclass(frozen=True)
class Plan:
    """The next batches, as indices into :attr:`Snapshot.requests`."""

    prefill: list[list[int]]  #: one list per LLM stage, in the order the calls are made
    decode: list[list[int]]  #: likewise
    no_ahead: frozenset[int]  #: decode rows whose token completes their first chunk (``LLMState.no_ahead``)
    chunks: list[ChunkBatch]  #: first-chunk batches, then later-chunk batches


def yields(r: RequestView, limits: Limits, first_busy: bool) -> bool:
    """Whether ``r``'s LM skips this step to leave the GPU to a first chunk being solved.

    While the chunk side computes someone's first audio, only LMs that have not reached their own first chunk
    keep decoding: the others are ahead of their listeners anyway, and their decode kernels would share the GPU
    with (and slow down) the solve that someone is waiting for.  An LM whose own first chunk is ready pauses at
    once, before the chunk side has taken it: its next tokens are for a chunk a whole first chunk of audio
    later, and a decode turn in between would hold the GIL and the GPU while the chunk side starts that solve
    (the time to first audio of a lone stream).  Only with the sides overlapped: serially nothing runs beside."""
    if not limits.first_chunk_priority or not limits.overlap:
        return False
    if r.emitted == 0 and r.pending:
        return True
    if not first_busy:
        return False
    return r.emitted > 0 or r.pending or r.busy


def completes_first_chunk(r: RequestView, limits: Limits) -> bool:
    """Whether ``r``'s next token makes its first chunk due (so :func:`yields` pauses its LM right after): the
    LLM stage is then told not to launch the step after ahead (``LLMState.no_ahead``)."""
    return (limits.overlap and limits.first_chunk_priority and r.stream and r.emitted == 0 and not r.pending
            and r.tokens_short == 1)


def admissions(waiting: int, running: int, limits: Limits) -> int:
    """How many waiting requests (oldest first) start now: as many as there are free streams."""
    return max(0, min(waiting, limits.max_streams - running))


def _free(snap: Snapshot, llm: int) -> int | None:
    return snap.free_slots.get(llm)


def _by_llm(rows: list[int], snap: Snapshot) -> list[list[int]]:
    """``rows`` grouped by LLM stage, groups in first-seen order, rows in their order."""
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(snap.requests[i].llm, []).append(i)
    return list(groups.values())


def _decodable(r: RequestView, limits: Limits, first_busy: bool) -> bool:
    return (r.phase is Phase.DECODING and not r.cancelled and r.llm_ready
            and not yields(r, limits, first_busy))


def llm_has_work(snap: Snapshot, limits: Limits) -> bool:
    """Whether the LLM worker has anything to do now (else it waits on the condition: never a busy loop): a
    slot to give back, a request to admit, drop or open a segment for, a prefill a slot is free for, a
    decodable LM, or (serially, where the same worker runs the chunks) a ready chunk."""
    if snap.releases or (snap.waiting and len(snap.requests) < limits.max_streams):
        return True
    for r in snap.requests:
        if r.cancelled or r.phase is Phase.OPENING:
            return True
        if r.phase is Phase.PREFILL:
            free = _free(snap, r.llm)
            if free is None or free > 0:
                return True
        elif _decodable(r, limits, snap.first_busy):
            return True
        if not limits.overlap and r.pending:
            return True
    return False


def chunk_has_work(snap: Snapshot) -> bool:
    """Whether any running request has a chunk call ready (the chunk worker waits otherwise)."""
    return any(r.pending and r.phase is not Phase.DONE for r in snap.requests)


def plan(snap: Snapshot, limits: Limits) -> Plan:
    """The next prefill, decode and chunk batches for ``snap`` (see the module docstring for the rules)."""
    reqs = snap.requests
    starting = [i for i, r in enumerate(reqs) if r.phase is Phase.PREFILL]
    prefill = []
    for group in _by_llm(starting, snap):
        free = _free(snap, reqs[group[0]].llm)
        take = group if free is None else group[:max(0, free)]
        if take:
            prefill.append(take)
    rows = [i for i, r in enumerate(reqs) if _decodable(r, limits, snap.first_busy)]
    no_ahead = frozenset(i for i in rows if completes_first_chunk(reqs[i], limits))
    ready = [i for i, r in enumerate(reqs) if r.pending and r.phase is not Phase.DONE]
    first = [i for i in ready if reqs[i].emitted == 0]
    later = sorted((i for i in ready if reqs[i].emitted > 0), key=lambda i: reqs[i].deadline)
    step = max(1, limits.largest_solve)
    chunks = [ChunkBatch(tuple(first[k:k + step]), True) for k in range(0, len(first), step)]
    chunks += [ChunkBatch(tuple(later[k:k + step]), False) for k in range(0, len(later), step)]
    return Plan(prefill=prefill, decode=_by_llm(rows, snap), no_ahead=no_ahead, chunks=chunks)
