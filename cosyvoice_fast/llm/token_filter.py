"""Which of the speech LM's tokens reach the flow: a per-family rule, asked by the engine for every token.

CosyVoice3's LM emits "silent and breath" speech tokens that, in long runs, become long pauses; upstream lets at
most ``max_run`` of them in a row through to the flow and drops the rest of the run.  The LM itself is not
affected: it keeps every token it drew in its own history (the next step is fed the dropped token too, and the
repetition check counts it).  CosyVoice2 filters nothing (its rule is :data:`NO_FILTER`).

The rule is frozen data built from :class:`~cosyvoice_fast.config.model.LLMConfig`; the one piece of state, the
length of the current silent run, lives on the request's :class:`~cosyvoice_fast.llm.stage.LLMState`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_fast.config.model import LLMConfig


@dataclass(frozen=True, slots=True)
class TokenFilter:
    """At most ``max_run`` ids of ``silent_tokens`` in a row pass; any other id passes and ends the run.

    :meth:`step` is the whole rule: a silent id lengthens the run and is dropped once the run is longer than
    ``max_run``; any other id resets the run to 0.  An empty ``silent_tokens`` passes everything."""

    silent_tokens: frozenset[int] = frozenset()
    max_run: int = 0

    def __post_init__(self) -> None:
        if self.max_run < 0:
            raise ValueError(f"max_run must be >= 0, got {self.max_run}")

    @classmethod
    def for_config(cls, cfg: LLMConfig) -> "TokenFilter":
        """The family's rule (CosyVoice2: nothing filtered)."""
        if not cfg.silent_tokens:
            return NO_FILTER
        return cls(frozenset(int(t) for t in cfg.silent_tokens), int(cfg.max_silent_run))

    def step(self, run: int, token: int) -> tuple[bool, int]:
        """``(passes, new run length)`` for ``token`` after a silent run of length ``run``."""
        if token in self.silent_tokens:
            run += 1
            return run <= self.max_run, run
        return True, 0

    def apply(self, tokens: list[int] | tuple[int, ...]) -> list[int]:
        """The tokens of a whole stream that pass (a convenience for offline use and tests)."""
        out, run = [], 0
        for t in tokens:
            keep, run = self.step(run, int(t))
            if keep:
                out.append(int(t))
        return out


#: the rule of a family without a filter
NO_FILTER = TokenFilter()
