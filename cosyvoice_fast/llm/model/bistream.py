"""The speech LM's bi-streaming schedule: text arrives in chunks while speech tokens are decoded.

CosyVoice2 was trained to read text and speech interleaved (5 text rows, then 15 speech rows), so a voice agent
can start speaking while its words are still being written.  This module is that schedule as a pure state
machine around the LM: it says which rows to feed next (as :class:`Segment` descriptions, embedded by
:meth:`~cosyvoice_fast.llm.model.speech_lm.Qwen2LM.embed_segments`), whether the next token is forced, which ids the
sampler must not pick, and it consumes the token that was decided.  It owns no tensors, threads or clocks, so
the eager driver, a batched backend and the engine can all step it, and a request's whole LM-side state is this
one object plus its KV cache.

The schedule (what upstream's ``Qwen2LM.inference_bistream`` does; described in the fixture README):

- the *text stream* is the prompt text followed by every chunk; its rows wait in a queue;
- while prompt speech is unplaced, each 5 queued text rows are followed by the next (up to) 15 prompt speech
  rows; nothing is decoded until all prompt speech is placed;
- decoding needs 5 queued text rows at the start (after ``sos``, when there was no prompt speech) and after
  every fill token (the 5 rows then *replace* what is pending); with fewer it waits for the next chunk;
- in the text phase a fill is forced at ``nf`` (the slot after 15 speech tokens since the last fill; the first
  ``nf`` aligns to the prompt speech); the LM may also pick a fill itself, which restarts the count; eos is
  banned.  A fill ends decoding until the next chunk has been read;
- when the text ends, the pending rows (after a fill: the last step's input, fed a second time), every queued
  text row and ``task`` are fed at once, and decoding runs until eos.

Chunks are consumed in order and only when the schedule needs the next one (after a fill or while waiting),
exactly as upstream pulls its text generator, so the tokens depend on the chunk boundaries, never on timing.

CosyVoice3 (not recorded in its fixture; from the README's description): its own ids differ (eos, fill and the
ids that end generation come from :class:`BistreamSpec`), and the prompt text up to and including
``<|endofprompt|>`` is fed right after ``sos`` (only the rest of the prompt text joins the text stream), so the
start rule "5 text rows after a lone ``sos``" does not apply to it, as upstream.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger(__name__)

PHASE_TEXT = 0
PHASE_FINAL = 1
SEGMENT_KINDS = ("sos", "task", "text", "prompt_speech", "speech")


@dataclass(frozen=True, slots=True)
class BistreamSpec:
    """The constants of the schedule: the text : speech interleave and the special speech-token ids.

    ``speech_token_size`` (S) is the number of real speech tokens; the LM's own ids follow it: ``extra_rows`` of
    them, eos at S + ``eos_offset`` and the fill at S + ``fill_offset`` (CosyVoice2: 3 ids, eos 6561, the id
    upstream rejects 6562, fill 6563; CosyVoice3: 200 ids, eos 6562, fill 6564).  ``endofprompt_id``: the text
    id that closes CosyVoice3's system prompt, which is fed right after sos (None: CosyVoice2, no such part)."""

    text_rows: int = 5
    speech_rows: int = 15
    speech_token_size: int = 6561
    eos_offset: int = 0
    fill_offset: int = 2
    extra_rows: int = 3
    endofprompt_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("text_rows", "speech_rows", "speech_token_size", "extra_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BistreamSpec.{name}={value!r}: must be a whole number >= 1")
        if not (0 <= self.eos_offset < self.extra_rows and 0 <= self.fill_offset < self.extra_rows
                and self.eos_offset != self.fill_offset):
            raise ValueError(f"BistreamSpec: eos_offset {self.eos_offset} and fill_offset {self.fill_offset} must "
                             f"differ and lie in 0 .. extra_rows - 1 = {self.extra_rows - 1}")

    @property
    def eos_id(self) -> int:
        return self.speech_token_size + self.eos_offset

    @property
    def invalid_id(self) -> int:
        """The first of the LM's own ids that is neither eos nor fill (upstream raises on any such id)."""
        return min(set(self.lm_ids) - {self.eos_id, self.fill_id})

    @property
    def fill_id(self) -> int:
        return self.speech_token_size + self.fill_offset

    @property
    def vocab_out(self) -> int:
        return self.speech_token_size + self.extra_rows

    @property
    def lm_ids(self) -> range:
        """The LM's own ids (not speech tokens)."""
        return range(self.speech_token_size, self.vocab_out)

    def banned(self, phase: int) -> tuple[int, ...]:
        """Ids the sampler must not pick: every LM id but the fill while text may still come (upstream masks
        id S and raises on the others), every LM id but eos once it has ended (upstream raises on them).
        Masking them never changes a pick upstream completes; it turns upstream's crash into the best allowed
        token."""
        keep = self.fill_id if phase == PHASE_TEXT else self.eos_id
        return tuple(i for i in self.lm_ids if i != keep)


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive LM input rows of one kind: ``sos``/``task`` (a learned row), ``text`` (rows ``start ..``
    of the text stream), ``prompt_speech`` (rows of the prompt's speech tokens) or ``speech`` (the decided token
    at index ``start`` of :attr:`BistreamState.out`)."""

    kind: str
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"Segment.kind={self.kind!r}: use one of {', '.join(SEGMENT_KINDS)}")
        if self.start < 0 or self.length < 1:
            raise ValueError(f"Segment start={self.start}, length={self.length}: need start >= 0, length >= 1")

    def as_tuple(self) -> tuple[str, int, int]:
        return (self.kind, self.start, self.length)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward of the LM: feed ``segments`` at cache positions ``position ..``, then decide one token:
    ``forced`` when the schedule fixes it (the sampler is not consulted), else sample with ``banned`` masked."""

    segments: tuple[Segment, ...]
    position: int
    phase: int
    forced: int | None
    banned: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True, slots=True)
class Event:
    """A branch the schedule took: ``label``, chunks read so far, ``n`` = decided tokens (for ``fill``/``eos``
    the token's own index) and the label's numbers (rows moved, or the fill index and the next forced one)."""

    label: str
    chunks: int
    n: int
    numbers: tuple[int, ...] = ()


class BistreamError(RuntimeError):
    """The schedule was driven out of order (text after its end, a token with no step asked for, a banned id)."""


@dataclass(eq=False)
class BistreamState:
    """One request's bi-streaming LM state.  Drive it with :meth:`push_text` / :meth:`end_text` (the text
    source) and :meth:`next_step` / :meth:`accept` (the LM); :attr:`waiting` says it needs more text first.

    ``max_tokens`` caps the speech tokens yielded (the consumer closing the stream); ``None`` = until eos.
    ``max_token_text_ratio`` adds upstream's usual safety cap once the text has ended: at most that many speech
    tokens per target-text token in all (upstream's bi-streaming has none, so a model that never picks eos would
    run forever; real speech ends with eos long before it).
    """

    spec: BistreamSpec
    prompt_text: Sequence[int]
    prompt_speech: Sequence[int]
    max_tokens: int | None = None
    max_token_text_ratio: float | None = None
    text_ids: list[int] = field(init=False)
    out: list[int] = field(default_factory=list, init=False)
    events: list[Event] = field(default_factory=list, init=False)
    next_fill: int = field(default=0, init=False)  # index in ``out`` of the next forced fill
    chunks_read: int = field(default=0, init=False)
    cache_len: int = field(default=0, init=False)
    phase: int = field(default=PHASE_TEXT, init=False)
    yielded: int = field(default=0, init=False)
    done: bool = field(default=False, init=False)
    eos_reached: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: use a whole number >= 1 or None (until eos)")
        if self.max_token_text_ratio is not None and not self.max_token_text_ratio > 0:
            raise ValueError(f"max_token_text_ratio={self.max_token_text_ratio!r}: use a number > 0 or None")
        self.text_ids = [int(i) for i in self.prompt_text]
        self.prompt_speech = [int(i) for i in self.prompt_speech]
        s = len(self.prompt_speech)
        self.next_fill = (s // self.spec.speech_rows + 1) * self.spec.speech_rows - s
        head = self._system_rows()
        self._queue_start = head  # first text-stream row still queued (rows before it were fed)
        self._speech_placed = 0
        self._pending: list[Segment] = [Segment("sos", 0, 1)] + ([Segment("text", 0, head)] if head else [])
        self._inbox: deque[list[int]] = deque()
        self._source_ended = False
        self._need_chunk = True  # the schedule reads the next chunk before it can decode
        self._plan: StepPlan | None = None
        self._advance()

    def _system_rows(self) -> int:
        """Prompt-text rows up to and including ``<|endofprompt|>`` (fed right after sos), 0 without one."""
        eop = self.spec.endofprompt_id
        if eop is None:
            return 0
        if eop not in self.text_ids:
            raise ValueError(f"bi-streaming needs the prompt text to hold <|endofprompt|> (text id {eop}): start it "
                             "with 'You are a helpful assistant.<|endofprompt|>' (the transcript, if any, after it)")
        return self.text_ids.index(eop) + 1

    # ------------------------------------------------------------------------------------------ text side

    def push_text(self, ids: Sequence[int]) -> None:
        """A chunk of text-token ids arrived (any length >= 1; its boundaries are part of the input)."""
        if self._source_ended:
            raise BistreamError("text arrived after the text source ended; start a new request for more text")
        chunk = [int(i) for i in ids]
        if not chunk:
            raise ValueError("an empty text chunk: send at least one token id per chunk (or none at all)")
        self._inbox.append(chunk)
        self._advance()

    def end_text(self) -> None:
        """The text source is exhausted: once the queued chunks are read, the final phase starts."""
        self._source_ended = True
        self._advance()

    @property
    def text_ended(self) -> bool:
        return self._source_ended

    @property
    def chunks_unread(self) -> int:
        """Chunks pushed but not read yet (the schedule reads one only when it needs text)."""
        return len(self._inbox)

    @property
    def queued_text(self) -> int:
        """Text rows read but not fed yet."""
        return len(self.text_ids) - self._queue_start

    @property
    def waiting(self) -> bool:
        """True while the schedule cannot decode until more text (or the end of the text) arrives."""
        return not self.done and self._need_chunk

    # ------------------------------------------------------------------------------------------ LM side

    def next_step(self) -> StepPlan | None:
        """The next forward, or ``None`` while :attr:`waiting` or once :attr:`done`.  Repeated calls return
        the same plan until :meth:`accept` consumes its token."""
        if self.done or self._need_chunk:
            return None
        if self._plan is None:
            forced = self.spec.fill_id if self.phase == PHASE_TEXT and len(self.out) == self.next_fill else None
            self._plan = StepPlan(tuple(self._pending), self.cache_len, self.phase, forced,
                                  self.spec.banned(self.phase))
        return self._plan

    def accept(self, token: int) -> int | None:
        """Consume the token decided for the current plan; returns it when it is a speech token to play,
        ``None`` for a fill or eos (never yielded)."""
        plan = self._plan
        if plan is None:
            raise BistreamError("accept() without a step: call next_step() and run the LM first")
        token = int(token)
        if plan.forced is not None and token != plan.forced:
            raise BistreamError(f"step {len(self.out)} is a forced fill ({plan.forced}), got {token}")
        if plan.forced is None and token in plan.banned:
            raise BistreamError(f"token {token} is not allowed in this phase (banned: {plan.banned})")
        if not 0 <= token < self.spec.vocab_out:
            raise BistreamError(f"token {token} is outside the LM's vocabulary (0 .. {self.spec.vocab_out - 1})")
        self._plan = None
        self.cache_len += plan.rows
        index = len(self.out)
        self.out.append(token)
        if token == self.spec.eos_id:  # only reachable in the final phase
            self._event("eos", index)
            self.done = self.eos_reached = True
            return None
        if token == self.spec.fill_id:  # only reachable in the text phase; pending stays what was just fed
            self.next_fill = index + self.spec.speech_rows + 1
            self._event("fill", index, (index, self.next_fill))
            self._need_chunk = True
            self._advance()
            return None
        self.yielded += 1
        self._pending = [Segment("speech", index, 1)]
        if self.cap is not None and self.yielded >= self.cap:
            self._event("cap", len(self.out))
            self.done = True
        return token

    @property
    def cap(self) -> int | None:
        """Speech tokens after which the stream stops: ``max_tokens``, and once the text has ended also
        ``max_token_text_ratio`` x target-text tokens (at least 1); ``None`` = until eos."""
        caps = [self.max_tokens] if self.max_tokens is not None else []
        if self.max_token_text_ratio is not None and self.phase == PHASE_FINAL:
            target = len(self.text_ids) - len(self.prompt_text)
            caps.append(max(1, int(target * self.max_token_text_ratio)))
        return min(caps) if caps else None

    def close(self) -> None:
        """The consumer stopped: no further steps."""
        self.done = True
        self._plan = None

    # ------------------------------------------------------------------------------------------ schedule

    def _event(self, label: str, n: int | None = None, numbers: tuple[int, ...] = ()) -> None:
        self.events.append(Event(label, self.chunks_read, len(self.out) if n is None else n, numbers))

    def _take_text(self, n: int) -> Segment:
        seg = Segment("text", self._queue_start, n)
        self._queue_start += n
        return seg

    def _advance(self) -> None:
        """Read queued chunks while the schedule needs one; start the final phase when the text has ended."""
        while self._need_chunk and not self.done:
            if self._inbox:
                self.chunks_read += 1
                self.text_ids.extend(self._inbox.popleft())
                self._need_chunk = not self._arrive()
            elif self._source_ended:
                self._finish_text()
            else:
                return

    def _arrive(self) -> bool:
        """A chunk was read (its rows are queued): place prompt speech, take text; True if decoding can run."""
        t, s = self.spec.text_rows, self.spec.speech_rows
        while self._speech_placed < len(self.prompt_speech):
            if self.queued_text < t:
                self._event("prompt_wait")
                return False
            m = min(s, len(self.prompt_speech) - self._speech_placed)
            self._pending += [self._take_text(t), Segment("prompt_speech", self._speech_placed, m)]
            self._speech_placed += m
            self._event("prompt_mix", numbers=(t, m))
        after_fill = bool(self.out) and self.out[-1] == self.spec.fill_id
        at_start = not self.out and [p.kind for p in self._pending] == ["sos"]
        if after_fill or at_start:
            self._event("need_text")
            if self.queued_text < t:
                self._event("text_wait")
                return False
            seg = self._take_text(t)
            self._pending = [seg] if after_fill else self._pending + [seg]
            self._event("text_append", numbers=(t,))
        return True

    def _finish_text(self) -> None:
        unplaced = len(self.prompt_speech) - self._speech_placed
        if unplaced:  # upstream drops it too; it only happens when the whole text is shorter than the prompt's
            log.warning("text ended with %d prompt speech tokens unplaced; they are dropped", unplaced)
        self._event("final")
        tail = [self._take_text(self.queued_text)] if self.queued_text else []
        self._pending = self._pending + tail + [Segment("task", 0, 1)]
        self.phase = PHASE_FINAL
        self._need_chunk = False
