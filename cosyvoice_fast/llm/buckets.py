"""KV-cache sizing rules shared by the graph-replayed LLM runners: which attention lengths get a decode graph,
which one a position needs, and how many tokens a request may draw in a slot.

Pure functions of integers (no tensors), so the ``cudagraph``/``fused`` runner and the bi-streaming runner size
their graphs and budgets identically.
"""

from __future__ import annotations

import logging
from typing import Collection, Sequence

from cosyvoice_fast.llm.model.kv_cache import KVCacheFullError

log = logging.getLogger(__name__)


def choose_kv_buckets(max_len: int, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
    """Sorted attention lengths to capture, always ending at ``max_len``.

    Default: powers of two from 256 below ``max_len``, then ``max_len`` (2048 -> 256, 512, 1024, 2048).
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if buckets is None:
        buckets = [1 << p for p in range(8, max_len.bit_length()) if (1 << p) < max_len]
    bad = [b for b in buckets if not 0 < b <= max_len]
    if bad:
        raise ValueError(f"kv buckets {bad} must lie in 1..max_len={max_len}")
    return tuple(sorted(set(buckets) | {max_len}))


def bucket_for(buckets: Sequence[int], pos: int) -> int:
    """The smallest bucket that holds position ``pos`` (it must attend over ``pos + 1`` positions)."""
    for b in buckets:
        if b > pos:
            return b
    raise KVCacheFullError(f"position {pos} is past the slot's {buckets[-1]} KV positions")


def token_budget(n_prompt: int, max_len: int, capacity: int, ignore_eos: bool) -> int:
    """How many tokens a request of ``n_prompt`` LM-input positions may draw in a slot of ``capacity``.

    Drawing ``m`` tokens writes ``n_prompt + m - 1`` positions (the last token is never fed back).  A fixed
    count (``ignore_eos``) that does not fit is an error; the usual 20x-text safety cap is shortened instead,
    since real speech ends with eos long before it.
    """
    if n_prompt > capacity:
        raise KVCacheFullError(f"the LM input has {n_prompt} positions but a slot holds {capacity}: shorten the "
                               "prompt/text or build the cudagraph backend with a larger max_len")
    room = capacity - n_prompt + 1
    if max_len <= room:
        return max_len
    if ignore_eos:
        raise KVCacheFullError(f"{max_len} forced tokens after a {n_prompt}-position input need "
                               f"{n_prompt + max_len - 1} KV positions, but a slot holds {capacity}")
    log.warning("cudagraph LLM: safety cap of %d tokens shortened to %d to fit the slot's %d KV positions",
                max_len, room, capacity)
    return room


def prefill_row_counts(slots: int, length: int, max_tokens: int) -> tuple[int, ...]:
    """Row counts captured for batched prefill at one padded ``length``: 1, 2, 4, ... while ``rows x length``
    stays within ``max_tokens`` (the scratch activations of the largest replay) and rows within ``slots``; the
    largest also covers a last partial power of two (``slots`` = 6 -> 1, 2, 4, 6).  Always at least one row."""
    if slots < 1 or length < 1 or max_tokens < 1:
        raise ValueError(f"prefill rows need slots, length and max_tokens >= 1, got {slots}, {length}, {max_tokens}")
    most = max(1, min(slots, max_tokens // length))
    return tuple(sorted({min(most, 1 << i) for i in range(most.bit_length() + 1)}))


def captured_shape(captured: Collection[tuple[int, int]], length: int, rows: int) -> tuple[int, int]:
    """The graph key ``(bucket, row count)`` to replay for a step that needs a bucket of at least ``length`` and
    at least ``rows`` rows, among the keys ``captured`` SO FAR: the smallest bucket that has one, then its
    smallest row count.  While the background thread still captures, a step pads up to a bigger captured
    graph (padded rows and positions are inert: see ``llm.graph``); the largest of each is always captured at
    start-up, so there is always one.  Raises :class:`KVCacheFullError` when nothing is that big."""
    fits = [k for k in captured if k[0] >= length and k[1] >= rows]
    if not fits:
        raise KVCacheFullError(f"no captured graph holds {length} positions x {rows} rows")
    return min(fits)
