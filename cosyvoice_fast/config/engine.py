"""``EngineConfig``: every capacity setting of one engine, in one validated place.

Capacity used to be constructor defaults scattered over the runners (LLM slots, KV length, flow buckets, row
counts, the engine's active limit).  A serving process sizes all of them together from one object, so that the
admission limit, the KV pool and the captured graph shapes can never disagree.  The LLM slot count defaults to
what the GPU's free memory holds (:func:`resolve_llm_slots`; the arithmetic is the pure
:func:`llm_slots_for_memory`), so one default serves an 80 GB and a 16 GB card.  Leaf module: imports nothing of
the runtime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from cosyvoice_fast.config.yamlfile import ConfigError

log = logging.getLogger(__name__)

#: bytes of one element per dtype name, for KV sizing without importing torch here
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "float32": 4, "float16": 2, "bfloat16": 2}


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
    - ``cuda_streams``: 2 runs the LLM side (prefill, decode) and the chunk side (flow + vocoder) in two worker
      threads, each on its own CUDA stream on a GPU (the LLM's at high priority), so flow solves do not stall
      decoding; on CPU the two threads still overlap.  1 runs both sides one after the other in one thread.
    - ``capture_at_start``: capture every graph the config names when the stage set is built (a progress bar),
      so nothing is captured while serving.
    - ``background_capture``: with ``capture_at_start``, capture only the graphs a first chunk at low
      concurrency needs (``config.graph_plan``'s ``first_chunk``) before the server reports ready, and the rest
      (more rows, other LLM KV buckets, final-chunk flow graphs, HiFT's later lengths) in one background thread
      after it; until then those shapes run eagerly (the LLM: padded to a captured bigger graph), never
      captured on a request's path.  Each capture holds ``kernels.gpu_gate.GPU_GATE`` alone (engine turns and
      admissions wait for it, milliseconds).  Off by default (``--background-capture`` turns it on): on GPUs a
      capture beside serving work was invalidated (H100) or deadlocked (H200), and the LLM's captures on the new
      thread failed in ``cublasCreate`` (H200); the gate, the thread's BLAS set-up and the pool release that
      answer them have not passed the GPU test yet.  Off, every graph is captured before ready, as before.
    - ``llm_memory_fraction``: share of the free GPU memory (read when the LLM stage is built) that the KV cache
      may take when ``llm_slots`` is ``None``; the rest is left to flow/vocoder graphs and their buffers.
    - ``stage_variants``: built implementations kept per stage (LLM, flow, vocoder); the least recently used one
      beyond it is dropped.  3 keeps the default set and both sides of an A/B comparison warm.
    - ``first_chunk_wait_ms``: with ``cuda_streams == 2``, how long a ready first chunk may wait for other
      requests whose first chunk is a few tokens away (:func:`~cosyvoice_fast.config.schedule.first_chunk_wait`), so
      that they share one solve instead of the later ones waiting for a whole solve; 0 never waits.
    - ``later_chunk_wait_ms``: the same for later chunks (streams decoding side by side reach them a few steps
      apart too), never while a listener has less than half a second of audio left
      (:func:`~cosyvoice_fast.config.schedule.later_chunk_wait`); 0 never waits.
    - ``first_chunk_priority``: with ``cuda_streams == 2``, while the chunk side solves a batch holding someone's
      first chunk, the LMs already past their own first chunk pause, so that solve has the GPU to itself (the
      lowest first audio); an LM whose own first chunk is ready pauses from then on (no step launched ahead of
      it either) until that chunk is out.  ``False`` keeps every LM decoding meanwhile: the GPU has decode steps
      to run in the solve's host gaps (more audio per second under load), and first chunks share the GPU with
      them.
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
    background_capture: bool = False
    llm_memory_fraction: float = 0.25
    stage_variants: int = 3
    first_chunk_wait_ms: float = 12.0
    later_chunk_wait_ms: float = 12.0
    first_chunk_priority: bool = True

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_context", "stage_variants"):
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
        for name in ("first_chunk_wait_ms", "later_chunk_wait_ms"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1000.0:
                raise ConfigError(f"EngineConfig.{name} must be a number of milliseconds in [0, 1000], got {w!r}")
        for name in ("capture_at_start", "background_capture", "first_chunk_priority"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        f = self.llm_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ConfigError(f"EngineConfig.llm_memory_fraction must be a number in (0, 1], got {f!r}")


def kv_bytes_per_token(qwen: Any, dtype: Any) -> int:
    """KV-cache bytes one LM position costs: layers x (K and V) x kv_heads x head_dim x element size.

    ``qwen`` is the model's :class:`~cosyvoice_fast.config.model.QwenConfig` (anything with ``num_hidden_layers``,
    ``num_key_value_heads`` and ``head_dim``); ``dtype`` a torch dtype or a name (``bf16``, ``float32``...)."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"kv_bytes_per_token: unknown dtype {dtype!r}; use fp32, fp16 or bf16")
    return int(qwen.num_hidden_layers) * 2 * int(qwen.num_key_value_heads) * int(qwen.head_dim) * _DTYPE_BYTES[name]


def llm_slots_for_memory(max_streams: int, max_context: int, bytes_per_token: int, free_bytes: int,
                         fraction: float) -> int:
    """How many LLM slots of ``max_context`` positions fit in ``fraction`` of ``free_bytes``, at most
    ``max_streams`` (more slots than streams could never be used).

    At least one slot when one fits in all of the free memory (a small GPU still serves one stream at a time);
    none fitting at all is an error naming the knob to turn."""
    per_slot = max_context * bytes_per_token
    n = int(free_bytes * fraction) // per_slot
    if n >= 1:
        return min(max_streams, n)
    if per_slot <= free_bytes:
        return 1
    raise ConfigError(f"EngineConfig.max_context: one LLM slot of {max_context} positions needs "
                      f"{per_slot / 2**20:.0f} MiB of KV cache but only {free_bytes / 2**20:.0f} MiB of GPU memory "
                      "is free; lower --max-context or free GPU memory")


def resolve_llm_slots(config: EngineConfig, qwen: Any, dtype: Any, device: Any) -> int:
    """``config.llm_slots`` if set; else ``max_streams`` on CPU (memory is not the limit there) or the slots
    that fit in ``llm_memory_fraction`` of the GPU's free memory now (call it after the weights are loaded)."""
    if config.llm_slots is not None:
        return config.llm_slots
    if getattr(device, "type", str(device)) != "cuda":
        return config.max_streams
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    per_token = kv_bytes_per_token(qwen, dtype)
    slots = llm_slots_for_memory(config.max_streams, config.max_context, per_token, free,
                                 config.llm_memory_fraction)
    log.info("LLM slots sized from free GPU memory: %d (%.1f GiB free, %.0f KiB per position, %d positions per "
             "slot, %.0f%% of free memory at most)", slots, free / 2**30, per_token / 1024, config.max_context,
             config.llm_memory_fraction * 100)
    return slots
