"""A bi-streamed request's text side: pieces in, LM schedule fed, arrival times kept for telemetry.

One object per request joins the incremental frontend (pieces -> final token ids) and the LM schedule
(:class:`~cosyvoice_fast.llm.model.bistream.BistreamState`, which reads id chunks when it needs them), and notes
when each piece arrived, so first audio can be measured from the first text piece and from the moment the 5th
text token reached the LM (the schedule cannot decode before 5 text rows are queued).  It holds no thread: the
engine (or a CLI loop) calls :meth:`TextFeed.push` as pieces come and steps the state while it is not waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the tokenizer package is absent on a GPU box that is fed token ids
    from cosyvoice_fast.frontend.text_stream import IncrementalText
from cosyvoice_fast.llm.model.bistream import BistreamState


@dataclass(frozen=True, slots=True)
class PieceArrival:
    """A text piece: when it arrived (clock seconds), its length in characters, the ids it released."""

    t: float
    chars: int
    ids_released: int


@dataclass(eq=False)
class TextFeed:
    """Pieces -> :class:`IncrementalText` -> :class:`BistreamState`, with arrival times.

    Released ids reach the schedule in chunks of exactly ``text_rows`` (5) ids, the rest at :meth:`end`.  Chunk
    boundaries are part of the LM's input (see the schedule's docstring), so regrouping makes the speech the same
    however the text was cut into pieces (whole, per token, per word) and whenever they came; it costs no
    latency, since the schedule cannot decode on fewer than 5 new text rows anyway."""

    text: IncrementalText
    state: BistreamState
    clock: Callable[[], float] = time.monotonic
    arrivals: list[PieceArrival] = field(default_factory=list)
    t_first_piece: float | None = None
    t_text_token_5: float | None = None  # when the 5th token of the target text reached the schedule
    t_end: float | None = None
    text_tokens: int = 0
    error: BaseException | None = None  # what stopped the text source early (the request fails with it)
    reader: Any = None  # the reader thread's handle (backends.bistream_llm.ReaderHandle)
    held: list[int] = field(default_factory=list)  # released ids not yet a whole chunk

    def push(self, piece: str) -> int:
        """One piece arrived; returns how many ids it released to the LM."""
        now = self.clock()
        if self.t_first_piece is None:
            self.t_first_piece = now
        ids = self.text.push(piece)
        self._feed(ids, now)
        self.arrivals.append(PieceArrival(now, len(piece), len(ids)))
        return len(ids)

    def end(self) -> int:
        """The text is complete: release what was held back and start the LM's final phase."""
        now = self.clock()
        ids = self.text.finish()
        self._feed(ids, now)
        if self.held:
            self.state.push_text(self.held)
            self.held = []
        self.state.end_text()
        self.t_end = now
        return len(ids)

    def _feed(self, ids: list[int], now: float) -> None:
        if not ids:
            return
        self.held += ids
        size = self.state.spec.text_rows
        while len(self.held) >= size:
            self.state.push_text(self.held[:size])
            self.held = self.held[size:]
        before, self.text_tokens = self.text_tokens, self.text_tokens + len(ids)
        if before < 5 <= self.text_tokens:
            self.t_text_token_5 = now


@dataclass(eq=False)
class IdText:
    """The :class:`IncrementalText` interface for text that arrives already tokenised (benchmarks, a GPU box
    without the tokenizer): pieces are sequences of text-token ids."""

    ids: list[int] = field(default_factory=list)

    def push(self, piece: Any) -> list[int]:
        try:
            new = [int(i) for i in (piece.reshape(-1).tolist() if hasattr(piece, "reshape") else piece)]
        except (TypeError, ValueError):
            raise TypeError(f"a pre-tokenised text source gives sequences of token ids, got {piece!r:.60}") from None
        self.ids += new
        return new

    def finish(self) -> list[int]:
        if not self.ids:
            raise ValueError("the text stream ended without anything to speak: send at least one token id")
        return []


def bistream_stage(engine: object, cfg: object) -> object:
    """The engine's bi-streaming LLM stage for ``cfg`` (built once per engine and LLM backend): the graph
    runner on CUDA with a graph LLM backend, else the eager runner."""
    from cosyvoice_fast.llm.bistream_eager import EagerBistream
    from cosyvoice_fast.llm.bistream_stage import BistreamLLM

    cache = engine.__dict__.setdefault("_bistream_stages", {})
    llm = engine.models.llm
    key = (cfg.llm, str(llm.speech_embedding.weight.dtype))
    if key not in cache:
        if engine.models.device.type == "cuda" and cfg.llm != "eager":
            from cosyvoice_fast.llm.bistream_graph import GraphBistream

            runner = GraphBistream(llm, slots=engine.config.max_streams)
        else:
            runner = EagerBistream(llm)
        cache[key] = BistreamLLM(runner)
    return cache[key]


def bistream_inputs(engine: object, request: object, stages: object, tele: object) -> tuple[object, object]:
    """Admit a request whose text is a source: the prompt side once, a :class:`TextFeed`, a reader thread that
    feeds it and wakes the engine, and a :class:`StageSet` whose LLM is the bi-streaming stage (flow and
    vocoder stay the engine's, so they batch with every other request).  Returns ``(stages, inputs)``."""
    import dataclasses

    import torch

    from cosyvoice_fast.llm.bistream_stage import start_reader

    cfg = stages.config
    stage = bistream_stage(engine, cfg)
    if request.inputs is not None:  # the prompt side given as model inputs; pieces are token-id sequences
        side, text = None, IdText()
        prompt_text, prompt_speech = request.inputs.prompt_text, request.inputs.llm_prompt_speech_token
    elif engine.frontend is None:
        raise ValueError("bi-streaming text needs a frontend (tokenizer) to read text pieces: load a complete "
                         "model directory, or pass inputs (the prompt side) and a source of token-id sequences")
    else:
        side = engine.frontend.prepare_prompt(request)
        tele.speaker_cache_hit = side.cache_hit
        prompt_text, prompt_speech = side.lm_prompt
        text = engine.frontend.text_stream()
    llm = engine.models.llm
    from cosyvoice_fast.llm.bistream_eager import bistream_spec

    state = BistreamState(bistream_spec(engine.models.llm), prompt_text.reshape(-1).tolist(), prompt_speech.reshape(-1).tolist(),
                          max_tokens=request.max_tokens, max_token_text_ratio=llm.cfg.max_token_text_ratio)
    feed = TextFeed(text, state)
    # the flow never reads the target text: one placeholder segment carries the request through the engine
    placeholder = [torch.zeros(1, 1, dtype=torch.int32)]
    inputs = (dataclasses.replace(request.inputs, text_segments=placeholder) if side is None
              else side.model_inputs(placeholder)).to(engine.models.device, cfg.torch_dtype)
    stage.attach(inputs, feed)

    def on_error(err: BaseException) -> None:
        feed.error = err

    def on_piece(t: float) -> None:  # telemetry: when each piece came, when the 5th text token reached the LM
        tele.text_arrivals.append(t)
        if feed.t_text_token_5 is not None:
            tele.text_token5 = feed.t_text_token_5

    feed.reader = start_reader(stage, feed, request.text_source, request.source_limits, engine.wake, on_error,
                               on_piece)
    return dataclasses.replace(stages, llm=stage), inputs
