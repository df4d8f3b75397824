"""All runtime state of one request, in one object.

The engine's worker thread is the only writer of the GPU-side fields; the consumer thread only reads the output
queue and may set ``cancelled``.  Nothing here is shared between requests (upstream kept per-request values in
uuid-keyed dicts and even on the shared model object).
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from cosyvoice_fast.llm.stage import LLMState
from cosyvoice_fast.engine.outbox import Outbox
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.config.schedule import ChunkCall, ChunkCursor
from cosyvoice_fast.telemetry.record import RequestTelemetry
from cosyvoice_fast.vocoder.stream import VocoderCache


class Phase(enum.Enum):
    """Where a request stands, as the scheduling policy (:mod:`~cosyvoice_fast.engine.policy`) sees it.

    Derived from the request's fields (:attr:`RequestState.phase`), never stored beside them, so it cannot
    disagree with them.  A request runs its text segments one after the other, passing OPENING -> PREFILL ->
    DECODING -> DRAINING for each."""

    WAITING = "waiting"  #: in the admission queue, no stream yet
    OPENING = "opening"  #: admitted, its next text segment not opened yet
    PREFILL = "prefill"  #: segment open, its LM waiting to be prefilled (for a free LLM slot)
    DECODING = "decoding"  #: its LM draws tokens
    DRAINING = "draining"  #: its LM is done; chunk calls of the segment remain
    DONE = "done"  #: ended (finished, cancelled or failed)


@dataclass(eq=False)
class SegmentState:
    """One text segment's speech-token stream: LM state, tokens so far, chunk cursor, vocoder carry-over.

    ``llm`` is the LM's whole per-request state (slot, position, history, generator, limits); the backend only
    executes batch calls over such states.  ``llm_started``: prefilled (a segment may wait for a free slot)."""

    index: int
    text: torch.Tensor
    cursor: ChunkCursor
    llm: LLMState | None = None
    llm_started: bool = False
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    pending: list[tuple[ChunkCall, float]] = field(default_factory=list)  # (call, tokens_ready time)
    voc_cache: VocoderCache | None = None
    flow_state: Any = None  # owned by the flow backend (e.g. incremental caches)
    flow_info: tuple[str, int, int] | None = None  # (mode, estimator frames, state bytes) of the last flow call

    def close(self, llm_stage: Any = None) -> None:
        """Give the LM's slot/KV cache back to ``llm_stage`` and drop the flow and vocoder state."""
        if self.llm is not None and llm_stage is not None:
            llm_stage.release(self.llm)
        self.llm = None
        self.flow_state = None
        self.voc_cache = None


@dataclass(eq=False)  # identity equality: field-wise == would compare tensors (and is meaningless here)
class RequestState:
    """A request in flight: inputs, parameters, generators, per-segment state, output queue, telemetry."""

    request: SynthesisRequest
    inputs: ModelInputs
    telemetry: RequestTelemetry
    stages: Any
    llm_generator: torch.Generator
    vocoder_generator: torch.Generator
    out: "queue.Queue[Any]" = field(default_factory=Outbox)  # awaitable by asyncio consumers
    cancelled: threading.Event = field(default_factory=threading.Event)
    segment: SegmentState | None = None
    next_segment: int = 0
    chunks_emitted: int = 0
    audio_samples_emitted: int = 0
    decode_steps: int = 0
    done: bool = False

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def phase(self) -> Phase:
        """This request's :class:`Phase` once admitted (the admission queue alone knows WAITING)."""
        seg = self.segment
        if self.done:
            return Phase.DONE
        if seg is None:
            return Phase.OPENING
        if not seg.llm_started:
            return Phase.PREFILL
        return Phase.DRAINING if seg.llm_done else Phase.DECODING

    def playback_deadline(self, sample_rate: int) -> float:
        """The earliest moment this request's listener can run out of audio (``perf_counter`` seconds): receipt
        plus the audio sent so far.  Playback starts at the first chunk's delivery, later than receipt, so the
        true moment is later by the first-audio time; ranking and waiting by this err toward urgency."""
        return self.telemetry.received + self.audio_samples_emitted / sample_rate

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close(self.stages.llm if self.stages is not None else None)
        self.segment = None
        self.done = True
