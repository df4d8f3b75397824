"""Which vocoder runner serves each (model family, backend): the vocoder folder's table for the stage factory.

CosyVoice2's HiFT runs in chunks with an 8-frame mel cache and a cross-fade (:mod:`~cosyvoice_fast.vocoder.stream`);
CosyVoice3's causal HiFT carries its own causal state between chunks.  Both are driven through the stage's
``vocode_jobs``; the engine never names a family.  CosyVoice3's ``fused`` is its cudagraph runner until fused causal
kernels exist (:data:`BACKENDS` says so in its note).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from cosyvoice_fast.config.backends import BackendUnavailable, Check, ask_module, runs_anywhere
from cosyvoice_fast.config.engine import EngineConfig

#: ``build(models, engine_config)``: the stage object (HiFT always runs in fp32: ``models.hift`` as loaded)
Build = Callable[[Any, EngineConfig], Any]

CV3_FUSED_NOTE = "fused = cudagraph for cosyvoice3 (no fused causal-HiFT kernels yet: the cudagraph runner serves it)"


def _cv2_eager(models: Any, engine: EngineConfig) -> Any:
    from cosyvoice_fast.vocoder.eager import EagerVocoder

    return EagerVocoder(models.hift)


def _cv2_graph(fused: bool) -> Build:
    def build(models: Any, engine: EngineConfig) -> Any:
        from cosyvoice_fast.config.graph_plan import first_chunk_frames
        from cosyvoice_fast.config.schedule import final_vocoder_frames, vocoder_frames
        from cosyvoice_fast.config.stream import StreamParams
        from cosyvoice_fast.vocoder.fused import FusedVocoder
        from cosyvoice_fast.vocoder.graph import CudaGraphVocoder

        # whole-chunk graphs for the default schedule's chunk lengths (every prompt length), captured now: the
        # non-final ones for every row count, the final ones for one row
        shape = (StreamParams(), models.config.chunk_size, models.config.token_mel_ratio)
        rows = engine.vocoder_rows if engine.capture_at_start else ()
        cls = FusedVocoder if fused else CudaGraphVocoder
        firsts = first_chunk_frames(*shape) if engine.background_capture else None  # the rest after ready
        return cls(models.hift, max_batch=max(engine.vocoder_rows), rows=rows, lengths=vocoder_frames(*shape),
                   final_lengths=final_vocoder_frames(*shape), defer_after=firsts)
    return build


def _cv3_eager(models: Any, engine: EngineConfig) -> Any:
    from cosyvoice_fast.vocoder.causal_eager import CausalEagerVocoder

    return CausalEagerVocoder(models.hift)


def _cv3_graph(models: Any, engine: EngineConfig) -> Any:
    from cosyvoice_fast.config.schedule import final_vocoder_frames, hop_for
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.vocoder.causal_graph import CausalGraphVocoder
    from cosyvoice_fast.vocoder.causal_stream import HELD_BACK, decode_windows

    # decode windows of the default schedule (every prompt length: the first hop depends on it), captured now for
    # every row count; final calls for one row: the left context, the held-back frames and the final chunk's
    # (a window not listed, e.g. a final call right after a short first one, runs eagerly)
    params, cs, ratio = StreamParams(), models.config.chunk_size, models.config.token_mel_ratio
    ctx = models.hift.decode_left_context()
    lengths = sorted({n for p in range(cs)
                      for n in decode_windows(ctx, [ratio * hop_for(i, p, params, cs) for i in range(16)])})
    finals = final_vocoder_frames(params, cs, ratio, cache_frames=ctx + HELD_BACK)
    if not engine.capture_at_start:
        lengths, finals = [], ()
    rows = engine.vocoder_rows
    return CausalGraphVocoder(models.hift, max_batch=max(rows), rows=rows, lengths=lengths, final_lengths=finals,
                              max_graphs=max(64, len(lengths) * len(rows) + len(finals)))  # keep every one


#: family -> runner name -> how to build it
RUNNERS: Mapping[str, Mapping[str, Build]] = {
    "cosyvoice2": {"eager": _cv2_eager, "cudagraph": _cv2_graph(False), "fused": _cv2_graph(True)},
    "cosyvoice3": {"eager": _cv3_eager, "cudagraph": _cv3_graph},
}

#: family -> backend -> runner (two backends naming one runner share the built object)
RESOLVE: Mapping[str, Mapping[str, str]] = {
    "cosyvoice2": {"eager": "eager", "cudagraph": "cudagraph", "fused": "fused"},
    "cosyvoice3": {"eager": "eager", "cudagraph": "cudagraph", "fused": "cudagraph"},
}

#: family -> backend -> (can it run here?, a note when the name means something else for this family)
BACKENDS: Mapping[str, Mapping[str, tuple[Check, str]]] = {
    "cosyvoice2": {"eager": (runs_anywhere, ""), "cudagraph": (ask_module("cosyvoice_fast.vocoder.graph"), ""),
                   "fused": (ask_module("cosyvoice_fast.vocoder.fused"), "")},
    "cosyvoice3": {"eager": (runs_anywhere, ""),
                   # the causal runner's rule is HiFT's (a CUDA device), asked of the module that states it
                   "cudagraph": (ask_module("cosyvoice_fast.vocoder.graph"), ""),
                   "fused": (ask_module("cosyvoice_fast.vocoder.graph"), CV3_FUSED_NOTE)},
}


def runner_for(family: str, backend: str) -> str:
    """The runner serving ``backend`` for ``family`` (the vocoder stage's cache key)."""
    return RESOLVE[family].get(backend, backend)


def build_vocoder(family: str, models: Any, runner: str, engine: EngineConfig) -> Any:
    """The vocoder stage object of ``runner`` for ``family``."""
    table = RUNNERS[family]
    if runner not in table:
        raise BackendUnavailable(f"vocoder runner {runner!r} is not written for {family}; choose one of "
                                 f"{', '.join(table)}")
    return table[runner](models, engine)
