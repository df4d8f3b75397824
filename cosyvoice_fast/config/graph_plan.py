"""Every CUDA graph a stage set captures at start-up, listed without a GPU: (family, shape), in capture order.

Start-up time on a fresh box is graph count x (capture + the Triton compiles of each new shape), so the count is
the first thing to know and to keep small.  The runners (``llm/graph.py``, ``flow/graph*.py``,
``vocoder/graph.py``) capture exactly these lists (``tests/test_startup.py`` checks the rules against theirs);
the start-up progress (``engine/startup.py``) shows ``capturing graphs N/M`` with ``M`` from here.

Each job says whether it comes before ready (``first_chunk``): what a first chunk at LOW concurrency needs.
That is the LLM's decode graphs for 1 and all rows at the smallest and the largest KV bucket and its prefill
graphs for 1 and the most rows per length (the runner pads a step up to the smallest CAPTURED bucket, so these
serve every shape), the incremental flow graphs, the streaming-attention encoder and estimator graphs of one
request (the smallest row bucket) and HiFT's first-chunk lengths for one row.  Everything else (more rows,
other KV buckets, full-attention flow graphs of final chunks, HiFT's later and final lengths) is captured after
ready, in the background, with ``EngineConfig.background_capture`` (:func:`split_ready`); until then the flow
and HiFT run such a shape eagerly (or on a bigger captured row bucket) and the LLM pads it.  Capture time is
per graph, so the count before ready is the restart time.  Pure arithmetic on counts; leaf module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.schedule import final_vocoder_frames, first_hop, vocoder_frames
from cosyvoice_fast.config.stream import StreamParams

#: estimator batch rows captured (a request is its CFG pair: 2 rows); ``flow/graph.py`` pads up to these
FLOW_ROW_SIZES = (2, 4, 8, 16, 32)
#: requests per flow-encoder graph (``flow/graph_encoder.py``)
ENCODER_ROWS = (1, 2, 4, 8, 16)
#: new-frame buckets of the incremental flow's graphs: a call pads its frames up to the next one (exact: padded
#: query frames sit after every real frame and are masked as keys); the per-step cost barely depends on the
#: frame count at these sizes, so a coarse list costs little
INCREMENTAL_FRAMES = (50, 100, 200, 300, 400)
#: key-capacity buckets of the incremental flow's graphs (positions attended, masked beyond the written ones)
INCREMENTAL_CAPACITY = (250, 500, 1000, 1500)
#: LLM prefill lengths and the scratch tokens of the largest prefill replay (``llm/graph.py``, ``llm/prefill.py``)
PREFILL_LENGTHS = (64, 128, 256, 512)
PREFILL_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class GraphJob:
    """One graph to capture: its family (``llm-decode``, ``llm-prefill``, ``flow-encoder``, ``flow-estimator``,
    ``flow-incremental``, ``hift``), its shape key, and whether a first chunk may replay it."""

    family: str
    shape: tuple[Any, ...]
    first_chunk: bool


# ---------------------------------------------------------------------------------------------- the LLM
def kv_buckets(max_len: int) -> tuple[int, ...]:
    """Decode attention lengths: powers of two from 256 below ``max_len``, then ``max_len``
    (``llm.buckets.choose_kv_buckets``'s default)."""
    return tuple(sorted({1 << p for p in range(8, max_len.bit_length()) if (1 << p) < max_len} | {max_len}))


def decode_rows(slots: int) -> tuple[int, ...]:
    """Batched decode row counts: 1, 2, 4, ... up to ``slots`` (``llm/graph.py``'s ``row_counts``)."""
    return tuple(sorted({min(slots, 2 ** i) for i in range(max(1, slots).bit_length() + 1)}))


def prefill_rows(slots: int, length: int, max_tokens: int = PREFILL_TOKENS) -> tuple[int, ...]:
    """Prefill row counts at one padded length (``llm.buckets.prefill_row_counts``)."""
    most = max(1, min(slots, max_tokens // length))
    return tuple(sorted({min(most, 1 << i) for i in range(most.bit_length() + 1)}))


def ready_first(jobs: Sequence[GraphJob]) -> list[GraphJob]:
    """``jobs`` with those captured before ready first, each part in its own order (how every runner captures:
    its ``now`` list, then its ``deferred`` list)."""
    return [j for j in jobs if j.first_chunk] + [j for j in jobs if not j.first_chunk]


def ends(values: Sequence[int]) -> set[int]:
    """The smallest and the largest of ``values``: the buckets captured before ready where a runner pads up."""
    return {min(values), max(values)} if values else set()


def llm_jobs(slots: int, max_len: int) -> list[GraphJob]:
    """Decode graphs per (KV bucket, rows), then prefill graphs per (length, rows); before ready only the
    smallest and largest KV bucket x 1 and all rows, and 1 and the most rows per prefill length (every step has
    a captured bucket at least as big: the largest is always there)."""
    kv, rows = kv_buckets(max_len), decode_rows(slots)
    decode = [GraphJob("llm-decode", (b, n), b in ends(kv) and n in ends(rows)) for b in kv for n in rows]
    prefill = [GraphJob("llm-prefill", (n, r), r in ends(prefill_rows(slots, n)))
               for n in PREFILL_LENGTHS if n <= max_len for r in prefill_rows(slots, n)]
    return ready_first(decode) + ready_first(prefill)


# ---------------------------------------------------------------------------------------------- the flow
def flow_row_buckets(rows: Sequence[int]) -> tuple[int, ...]:
    """Estimator row buckets serving ``rows`` requests per solve (2 CFG rows each)."""
    return tuple(sorted({next((s for s in FLOW_ROW_SIZES if s >= 2 * r), FLOW_ROW_SIZES[-1]) for r in rows}))


def estimator_jobs(buckets: Sequence[int], rows: Sequence[int]) -> list[GraphJob]:
    """Step graphs per (length, attention mode, rows) within the attention budget ``rows x len^2 <= 2 x max^2``;
    streaming (chunk-causal) graphs first: they serve first chunks of segments that recompute (one request's
    row bucket before ready)."""
    budget = 2 * max(buckets) ** 2
    row_buckets = flow_row_buckets(rows)
    fits = [(f, r) for f in sorted(buckets) for r in row_buckets if r * f * f <= budget]
    return ready_first([GraphJob("flow-estimator", (f, True, r), r == row_buckets[0]) for f, r in fits]
                       + [GraphJob("flow-estimator", (f, False, r), False) for f, r in fits])


def encoder_token_buckets(buckets: Sequence[int], stride: int) -> tuple[int, ...]:
    """Encoder token lengths: the estimator's frame buckets over the encoder's upsampling ``stride`` (frames
    per token: both stages pad alike)."""
    return tuple(sorted({max(1, f // stride) for f in buckets}))


def encoder_jobs(buckets: Sequence[int], rows: Sequence[int], stride: int) -> list[GraphJob]:
    """Encoder graphs per (token bucket, rows, mode) within ``rows x (stride x bucket)^2 <= 2 x (stride x
    longest)^2``; streaming first (one request's rows before ready)."""
    max_batch = min(max(rows), FLOW_ROW_SIZES[-1] // 2)
    enc_rows = tuple(r for r in ENCODER_ROWS if r <= max_batch) or (1,)
    toks = encoder_token_buckets(buckets, stride)
    budget = 2 * (stride * toks[-1]) ** 2
    fits = [(b, r) for b in toks for r in enc_rows if r * (stride * b) ** 2 <= budget]
    return ([GraphJob("flow-encoder", (b, r, True), r == enc_rows[0]) for b, r in fits]
            + [GraphJob("flow-encoder", (b, r, False), False) for b, r in fits])


def incremental_shapes(max_frames: int, max_solve_frames: int = 400, frames: Sequence[int] = INCREMENTAL_FRAMES,
                       capacity: Sequence[int] = INCREMENTAL_CAPACITY) -> list[tuple[int, int]]:
    """Every (new-frame bucket, key capacity) the incremental flow captures: frame buckets up to
    ``max_solve_frames``, capacities capped at the buffers' ``max_frames``, capacity >= frames."""
    caps = sorted({min(c, max_frames) for c in capacity} | {max_frames})
    return [(nb, cap) for nb in frames if nb <= min(max_solve_frames, max_frames) for cap in caps if cap >= nb]


def incremental_bucket(n: int, start: int, max_frames: int, frames: Sequence[int] = INCREMENTAL_FRAMES,
                       capacity: Sequence[int] = INCREMENTAL_CAPACITY) -> tuple[int, int] | None:
    """(frame bucket, key capacity) of a call of ``n`` new frames after ``start`` written ones; None when
    ``n`` exceeds every frame bucket.  Near the end of the buffers, where the bucket would run past them, the
    exact ``(n, max_frames)`` (no start-up graph: such a call, like a None one, runs eagerly)."""
    nb = next((f for f in frames if f >= n), None)
    if nb is None:
        return None
    if start + nb > max_frames:
        return n, max_frames
    caps = sorted({min(c, max_frames) for c in capacity} | {max_frames})
    cap = next((c for c in caps if c >= start + nb), max_frames)
    return nb, cap


def incremental_jobs(max_frames: int) -> list[GraphJob]:
    return [GraphJob("flow-incremental", s, True) for s in incremental_shapes(max_frames)]


# ---------------------------------------------------------------------------------------------- HiFT
def first_chunk_frames(params: StreamParams, chunk_size: int = 25, token_mel_ratio: int = 2) -> tuple[int, ...]:
    """Mel lengths of a first (non-final) vocoder call, for every prompt length."""
    return tuple(sorted({token_mel_ratio * first_hop(p, params, chunk_size) for p in range(chunk_size)}))


def hift_jobs(rows: Sequence[int], max_batch: int, chunk_size: int = 25, token_mel_ratio: int = 2,
              params: StreamParams | None = None) -> list[GraphJob]:
    """``vocoder/graph.py``'s start-up graphs in its capture order: every streamed (non-final) length x row
    count, shortest first (first chunks are the shortest streamed lengths), then the lengths only final chunks
    have, for the smallest row count.  Before ready: the first-chunk lengths for the smallest row count."""
    params = params or StreamParams()
    rows = tuple(sorted({r for r in rows if 1 <= r <= max_batch}))
    if not rows:
        return []
    firsts = set(first_chunk_frames(params, chunk_size, token_mel_ratio))
    streamed = sorted({(n, r) for n in vocoder_frames(params, chunk_size, token_mel_ratio) for r in rows})
    finals = sorted({(n, rows[0]) for n in final_vocoder_frames(params, chunk_size, token_mel_ratio)} - set(streamed))
    return ready_first([GraphJob("hift", j, j[0] in firsts and j[1] == rows[0]) for j in streamed + finals])


# ---------------------------------------------------------------------------------------------- a stage set
@dataclass(frozen=True, slots=True)
class PlanDims:
    """What the plan needs from the model (``ModelConfig``): the chunk schedule and the encoder's upsampling."""

    chunk_size: int = 25
    token_mel_ratio: int = 2
    encoder_stride: int = 2

    @classmethod
    def of(cls, model_config: Any) -> "PlanDims":
        enc = getattr(getattr(getattr(model_config, "flow", None), "encoder", None), "upsample_stride", 2)
        return cls(int(model_config.chunk_size), int(model_config.token_mel_ratio), int(enc))


#: fixed buffer frames of the incremental flow (``flow/graph_incremental.py``'s ``DEFAULT_STATE_FRAMES``)
STATE_FRAMES = 1500


def stage_jobs(stage: str, backend: str, engine: EngineConfig, dims: PlanDims, *, incremental: bool = True,
               llm_slots: int | None = None) -> list[GraphJob]:
    """The graphs one stage implementation captures when it is built (none for the eager and TensorRT ones, or
    with ``capture_at_start`` off)."""
    graphed = backend in ("cudagraph", "fused")
    if stage == "llm" and graphed:
        return llm_jobs(llm_slots or engine.llm_slots or engine.max_streams, engine.max_context)
    if not engine.capture_at_start or not graphed:
        return []
    if stage == "flow":
        jobs = (incremental_jobs(STATE_FRAMES) if incremental else [])
        enc = encoder_jobs(engine.flow_buckets, engine.flow_rows, dims.encoder_stride)
        return (jobs + [j for j in enc if j.first_chunk] + estimator_jobs(engine.flow_buckets, engine.flow_rows)
                + [j for j in enc if not j.first_chunk])
    if stage == "vocoder":
        return hift_jobs(engine.vocoder_rows, max(engine.vocoder_rows), dims.chunk_size, dims.token_mel_ratio)
    return []


def graph_plan(configs: Sequence[BackendConfig], engine: EngineConfig, dims: PlanDims | None = None,
               llm_slots: int | None = None) -> list[GraphJob]:
    """Every graph building ``configs`` (in order) captures, in capture order: stages shared between configs
    (same stage, backend and dtype) are built, and counted, once."""
    dims = dims or PlanDims()
    seen: set[tuple[str, str, str, bool]] = set()
    out: list[GraphJob] = []
    for cfg in configs:
        for stage in ("llm", "flow", "vocoder"):
            name = getattr(cfg, stage)
            key = (stage, name, "fp32" if stage == "vocoder" else cfg.dtype,
                   bool(cfg.incremental) if stage == "flow" else False)
            if key in seen:
                continue
            seen.add(key)
            out += stage_jobs(stage, name, engine, dims, incremental=cfg.incremental, llm_slots=llm_slots)
    return out


def split_ready(jobs: Sequence[GraphJob], engine: EngineConfig) -> tuple[list[GraphJob], list[GraphJob]]:
    """(the graphs captured before the server reports ready, those its background thread captures after):
    with ``background_capture`` (and ``capture_at_start``) every ``first_chunk`` graph comes first and the rest
    after; without it all come before ready.  The runners split by the same flag and the same rule (see the
    module docstring; ``tests/test_startup_background.py`` checks them against this list)."""
    if not (engine.background_capture and engine.capture_at_start):
        return list(jobs), []
    return [j for j in jobs if j.first_chunk], [j for j in jobs if not j.first_chunk]


def plan_counts(jobs: Sequence[GraphJob]) -> dict[str, int]:
    """Graphs per family, in first-appearance order."""
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.family] = counts.get(j.family, 0) + 1
    return counts


def planned_graphs(configs: Sequence[BackendConfig], engine: EngineConfig, model_config: Any) -> int:
    """How many graphs building ``configs`` captures before ready (the ``M`` of start-up's ``N/M``; the
    background captures come on top: :func:`split_ready`); 0 (unknown: the progress then shows the count so far)
    for a model family whose runners this plan does not describe (CosyVoice3's DiT flow and causal HiFT)."""
    if getattr(model_config, "family", "cosyvoice2") != "cosyvoice2":
        return 0
    return len(split_ready(graph_plan(configs, engine, PlanDims.of(model_config)), engine)[0])
