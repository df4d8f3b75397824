"""``EngineConfig``: every capacity setting of one engine, in one validated place.

Capacity used to be constructor defaults scattered over the runners (LLM slots, KV length, flow buckets, row
counts, the engine's active limit).  A serving process sizes all of them together from one object, so that the
admission limit, the KV pool and the captured graph shapes can never disagree.  Leaf module: imports nothing of
the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from .yamlconf import ConfigError


def _positive_tuple(name: str, values: tuple[int, ...]) -> None:
    if not isinstance(values, tuple) or not values:
        raise ConfigError(f"EngineConfig.{name} must be a non-empty tuple of positive integers, got {values!r}")
    if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise ConfigError(f"EngineConfig.{name} must hold positive integers only, got {values!r}")
    if list(values) != sorted(set(values)):
        raise ConfigError(f"EngineConfig.{name} must be strictly increasing, got {values!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity of one engine on one device.

    - ``max_streams``: requests running at once (admitted: prefill, decoding, or still streaming flow/vocoder
      chunks).  Requests beyond it wait in the admission queue.
    - ``llm_slots``: LLM KV-cache slots (one per request whose LM is running).  ``None`` sizes it at start-up:
      from free GPU memory on CUDA (capped at ``max_streams``), ``max_streams`` on CPU.
    - ``max_context``: LM positions per slot (prompt text + prompt speech + text + generated speech tokens).
    - ``queue_limit``: requests waiting for admission; one more is refused with ``EngineBusy``.
    - ``flow_buckets``: mel-frame lengths whose estimator graphs are captured at start-up (a call is padded up to
      the next bucket; longer calls run eagerly).
    - ``flow_rows``: batch rows (requests per solve, before the CFG pair doubles them) captured per bucket.
    - ``vocoder_rows``: HiFT chunk batch sizes captured.
    - ``cuda_streams``: 2 runs the LLM on one CUDA stream and flow + vocoder on another (overlapped); 1 runs
      them one after the other.  Ignored on CPU.
    - ``capture_at_start``: capture every graph the config names when the stage set is built (a progress bar),
      so nothing is captured while serving.
    """

    max_streams: int = 64
    llm_slots: int | None = None
    max_context: int = 2048
    queue_limit: int = 64
    flow_buckets: tuple[int, ...] = (50, 100, 150, 200, 250, 300, 400, 500, 750, 1000, 1500)
    flow_rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    vocoder_rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    cuda_streams: int = 2
    capture_at_start: bool = True

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"EngineConfig.{name} must be a positive integer, got {v!r}")
        if self.llm_slots is not None and (not isinstance(self.llm_slots, int) or isinstance(self.llm_slots, bool)
                                           or self.llm_slots < 1):
            raise ConfigError(f"EngineConfig.llm_slots must be a positive integer or None (size from free GPU "
                              f"memory), got {self.llm_slots!r}")
        if not isinstance(self.queue_limit, int) or isinstance(self.queue_limit, bool) or self.queue_limit < 0:
            raise ConfigError(f"EngineConfig.queue_limit must be an integer >= 0, got {self.queue_limit!r}")
        if self.max_context < 64:
            raise ConfigError(f"EngineConfig.max_context must be at least 64 LM positions, got {self.max_context}")
        for name in ("flow_buckets", "flow_rows", "vocoder_rows"):
            _positive_tuple(name, getattr(self, name))
        if self.cuda_streams not in (1, 2):
            raise ConfigError(f"EngineConfig.cuda_streams must be 1 or 2, got {self.cuda_streams!r}")
