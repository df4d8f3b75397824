"""The streaming chunk schedule: when a chunk of speech tokens is ready for the flow, and how long it is.

Pure arithmetic on counts, no tensors, so it is exact, cheap and testable against upstream's recorded calls.

Upstream's default (token_hop_len 25, scale 2, max 100, look-ahead 3): the first hop is padded so that
prompt + first hop is a multiple of the flow's 25-token attention chunk, then hops double up to 100.  With a
20-token prompt and 90 tokens that gives calls of 33 tokens (30 + 3 look-ahead), 83 (80 + 3) and a final call
with all 90.  Every parameter here comes from the request (upstream kept the hop on the shared model object,
so a second request started with a 100-token first chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from cosyvoice_fast.config.stream import StreamParams

#: mel frames each non-final vocoder call re-vocodes from the previous chunk (left context for HiFT)
MEL_CACHE_FRAMES = 8


@dataclass(frozen=True, slots=True)
class ChunkCall:
    """One flow call: tokens ``[0, n_tokens)`` are passed; frames before ``2*token_offset`` are already emitted."""

    index: int
    token_offset: int
    hop: int
    n_tokens: int
    lookahead: int
    finalize: bool


def first_hop(prompt_tokens: int, params: StreamParams, chunk_size: int = 25) -> int:
    """Tokens the first chunk emits.

    With the default ``token_hop_len_first`` (= chunk size) the hop is padded as upstream does so that
    prompt + hop ends on a chunk boundary; a shorter first hop is taken as asked (no padding), trading an
    unaligned first chunk for earlier audio.
    """
    hop = params.token_hop_len_first
    if hop == chunk_size:
        hop += math.ceil(prompt_tokens / chunk_size) * chunk_size - prompt_tokens
    return hop


def hop_for(index: int, prompt_tokens: int, params: StreamParams, chunk_size: int = 25) -> int:
    """Tokens chunk ``index`` emits (chunk 0: :func:`first_hop`; then ``token_hop_len * scale**index`` capped)."""
    if index == 0:
        return first_hop(prompt_tokens, params, chunk_size)
    return int(min(params.token_max_hop_len, params.token_hop_len * params.stream_scale_factor ** index))


class ChunkCursor:
    """Walks the schedule for one speech-token stream (one text segment of one request).

    ``next_call(n_available, llm_done)`` answers with the next :class:`ChunkCall` as soon as enough tokens exist,
    or ``None``.  It is owned by the request's state; nothing here is shared between requests.
    """

    def __init__(self, prompt_tokens: int, params: StreamParams, chunk_size: int = 25):
        self.prompt_tokens = prompt_tokens
        self.params = params
        self.chunk_size = chunk_size
        self.index = 0
        self.token_offset = 0
        self.finished = False

    def next_call(self, n_available: int, llm_done: bool) -> ChunkCall | None:
        if self.finished:
            return None
        hop = hop_for(self.index, self.prompt_tokens, self.params, self.chunk_size)
        la = self.params.pre_lookahead_len
        if n_available >= self._due():
            call = ChunkCall(self.index, self.token_offset, hop, self._due(), la, finalize=False)
            self.token_offset += hop
            self.index += 1
            return call
        if llm_done:
            self.finished = True
            return ChunkCall(self.index, self.token_offset, n_available - self.token_offset, n_available, 0,
                             finalize=True)
        return None

    def _due(self) -> int:
        """Tokens the next non-final call needs: everything up to its hop, plus the look-ahead."""
        hop = hop_for(self.index, self.prompt_tokens, self.params, self.chunk_size)
        return self.token_offset + hop + self.params.pre_lookahead_len

    def tokens_short(self, n_available: int) -> int:
        """How many more tokens the next (non-final) call needs; 0 when it is due (or the cursor is done)."""
        return 0 if self.finished else max(0, self._due() - n_available)

    def tokens_to_next_call(self, n_available: int, tokens_left: int) -> int:
        """How many more tokens until this cursor's next call of any kind: the next hop's, or the final one when
        the LM stops after ``tokens_left`` more tokens (its length limit; a stop token may come sooner, which
        nobody can foresee); 0 when a call is due or the cursor is done."""
        return 0 if self.finished else min(self.tokens_short(n_available), max(0, tokens_left))


#: a ready first chunk waits for another request's first chunk only while that one is this many tokens away
GATHER_TOKENS = 4


def first_chunk_wait(ready_since: float, now: float, tokens_short: Sequence[int], max_wait_s: float,
                     reach: int = GATHER_TOKENS) -> float:
    """Seconds a batch of ready first chunks should stay open before its solve, or 0 to run it now.

    Requests reach their first chunk a few decode steps apart (their prefills ran in different turns, their
    prompts pad the first hop differently); solved at once, the later ones wait for the whole first solve.  So
    while some other request's first chunk is at most ``reach`` tokens away (``tokens_short``, those still
    decoding toward theirs) the batch waits, until ``max_wait_s`` after its oldest chunk became ready."""
    left = ready_since + max_wait_s - now
    if left <= 0 or not any(0 < n <= reach for n in tokens_short):
        return 0.0
    return left


#: a ready later chunk waits for others only while its listener has at least this much audio left to play
LATER_SLACK_S = 0.5


def later_chunk_wait(ready_since: float, now: float, deadline: float, tokens_short: Sequence[int],
                     max_wait_s: float, reach: int = GATHER_TOKENS, slack_s: float = LATER_SLACK_S) -> float:
    """Seconds a batch of ready later chunks should stay open before its solve, or 0 to run it now.

    Streams decoding side by side reach their later chunks (and their final ones, at equal length limits) a few
    steps apart too, and a chunk solved alone makes the others wait for that whole solve.  A later chunk has
    its listener's queued audio as slack, so it waits like a first chunk (:func:`first_chunk_wait`), but never
    while the most urgent listener (``deadline``: when it runs out of audio) has less than ``slack_s`` left
    after the wait."""
    left = first_chunk_wait(ready_since, now, tokens_short, max_wait_s, reach)
    return max(0.0, min(left, deadline - now - slack_s))


def call_frames(call: ChunkCall, prompt_tokens: int, token_mel_ratio: int = 2) -> int:
    """Estimator time length for one flow call: prompt + encoded tokens (look-ahead tokens are not encoded)."""
    encoded = call.n_tokens - (0 if call.finalize else call.lookahead)
    return token_mel_ratio * (prompt_tokens + encoded)


def vocoder_frames(params: StreamParams, chunk_size: int = 25, token_mel_ratio: int = 2,
                   cache_frames: int = MEL_CACHE_FRAMES, max_chunks: int = 16) -> tuple[int, ...]:
    """Mel lengths of the non-final vocoder calls ``params`` produces, for any prompt length: a first chunk is
    ``ratio x first hop`` (the hop depends on the prompt length modulo ``chunk_size``), a later one
    ``cache_frames + ratio x hop``.  HiFT graphs are keyed by exact length (its convolutions look both ways, so
    padding would change the last samples), so these are the lengths worth capturing ahead of serving; final
    chunks take whatever is left and are not listed."""
    first = {token_mel_ratio * first_hop(p, params, chunk_size) for p in range(chunk_size)}
    later = {cache_frames + token_mel_ratio * hop_for(i, 0, params, chunk_size) for i in range(1, max_chunks)}
    return tuple(sorted(f for f in first | later if f > 0))


def final_vocoder_frames(params: StreamParams, chunk_size: int = 25, token_mel_ratio: int = 2,
                         cache_frames: int = MEL_CACHE_FRAMES, max_chunks: int = 16) -> tuple[int, ...]:
    """Mel lengths a streamed segment's final vocoder call can have, for any prompt and utterance length.

    The final call comes when the LM stops before the next chunk is due, so it holds fewer tokens than that
    chunk's hop plus look-ahead: ``ratio x n`` for ``n < first hop + look-ahead`` when it is also the first call,
    else ``cache_frames + ratio x r`` for ``r < hop + look-ahead``.  About a hundred lengths with the defaults:
    few enough to capture one-row HiFT graphs for all of them at start-up instead of one per new length while
    serving."""
    la = params.pre_lookahead_len
    first = max(first_hop(p, params, chunk_size) for p in range(chunk_size))
    hop = max(hop_for(i, 0, params, chunk_size) for i in range(1, max_chunks))
    alone = {token_mel_ratio * n for n in range(1, first + la)}
    later = {cache_frames + token_mel_ratio * r for r in range(1, hop + la)}
    return tuple(sorted(alone | later))


def bucket_frames(frames: int, granularity: int = 50) -> int:
    """The captured length serving an estimator input of ``frames`` frames: the next multiple of
    ``granularity`` (at least one granule)."""
    if frames < 1:
        raise ValueError(f"an estimator input needs at least one frame, got {frames}")
    if granularity < 1:
        raise ValueError(f"bucket granularity must be >= 1, got {granularity}")
    return max(1, math.ceil(frames / granularity)) * granularity


def plan(prompt_tokens: int, total_tokens: int, params: StreamParams, chunk_size: int = 25) -> list[ChunkCall]:
    """The whole schedule for a stream whose final length is known (tests, the dashboard's 'what it buys')."""
    cur = ChunkCursor(prompt_tokens, params, chunk_size)
    calls = []
    while (c := cur.next_call(total_tokens, llm_done=True)) is not None:
        calls.append(c)
    return calls


def schedule_frames(prompt_tokens: int, total_tokens: int, params: StreamParams | None = None,
                    chunk_size: int = 25, token_mel_ratio: int = 2) -> list[tuple[int, bool]]:
    """``(frames, streaming)`` of every estimator input the streamed schedule produces for one segment
    (non-final calls use chunk-causal attention, the final call full attention): what graph runners capture."""
    params = params or StreamParams()
    return [(call_frames(c, prompt_tokens, token_mel_ratio), not c.finalize)
            for c in plan(prompt_tokens, total_tokens, params, chunk_size)]


def plan_solves(frames: list[int], max_items: int, cost: Callable[[int, int], float] | None = None,
                budget: float | None = None, same_length: bool = False) -> list[list[int]]:
    """Split item indices (with estimator lengths ``frames``) into batched solves.

    Items are taken shortest first (similar lengths share a solve: less padding), at most ``max_items`` per
    solve, and while ``cost(n_items, longest_frames) <= budget`` when both are given (a solve that would
    exceed the budget starts a new one; a single item always fits).  ``same_length`` lets only equal lengths
    share a solve (no padding at all)."""
    order = sorted(range(len(frames)), key=lambda i: frames[i])
    groups: list[list[int]] = []
    for i in order:  # ascending, so item i is the longest of the solve it joins
        g = groups[-1] if groups else None
        if g is not None and len(g) < max_items and (not same_length or frames[g[0]] == frames[i]) and (
                cost is None or budget is None or cost(len(g) + 1, frames[i]) <= budget):
            g.append(i)
        else:
            groups.append([i])
    return groups
