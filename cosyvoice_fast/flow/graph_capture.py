"""What the graph-captured CosyVoice2 flow captures at start-up, and what it leaves for after ready.

In the order first chunks need them (``config.graph_plan.stage_jobs``): the incremental graphs, the streaming
(chunk-causal) encoder and estimator graphs, then the full-attention ones, which only final chunks replay.  With
background capture on (``EngineConfig.background_capture``) only the incremental graphs and the streaming graphs
of ONE request (the smallest row bucket) are captured here: the rest (bigger row buckets, full attention) become
:class:`~cosyvoice_fast.kernels.graphs.DeferredCapture` jobs on the runner's ``deferred`` list, which the engine
runs in its background capture thread once the server is ready.  Until then a call of such a shape runs
eagerly (counted in the runner's ``eager_calls``; a batch of several requests too), never captured on the
request's path.
"""

from __future__ import annotations

from typing import Any, Sequence

from cosyvoice_fast.config.graph_plan import flow_row_buckets


def capture_flow(runner: Any, rows: Sequence[int], progress: bool = True, defer: bool = False) -> int:
    """Capture ``runner``'s (a ``CudaGraphFlow``) start-up graphs for ``rows`` requests per solve, freeze its
    caches, and with ``defer`` set ``runner.deferred``; returns the graphs captured now."""
    from tqdm.auto import tqdm

    est, enc = runner.estimator, runner.encoder
    dtype = next(runner.flow.parameters()).dtype
    n = runner.incremental.graphs.capture_all(progress=progress) if runner.incremental is not None else 0
    lengths = est.buckets or tuple(range(est.granularity, est.max_frames + 1, est.granularity))
    row_buckets = flow_row_buckets(rows)  # the row bucket of each request count (its CFG pair: 2 rows)
    jobs = [(f, s, r) for s in (True, False) for f in lengths for r in row_buckets if est._fits(r, f)]
    for cache in est.all_caches():
        cache.max_graphs = max(cache.max_graphs, len(jobs))
    enc_jobs = enc.jobs()
    enc_first = min(enc.rows)
    # before ready with ``defer``: streaming graphs of one request; without: every streaming graph, then the rest
    enc_now = [j for j in enc_jobs if j[2] and (j[1] == enc_first or not defer)]
    n += enc.capture_jobs(enc_now, dtype, progress)
    now = [j for j in jobs if j[1] and (j[2] == row_buckets[0] or not defer)] + ([] if defer else
                                                                                 [j for j in jobs if not j[1]])
    for f, s, r in tqdm(now, desc="capturing flow graphs", unit="graph", disable=not progress, leave=False):
        est.capture(f, s, dtype, r)
    later = [j for s in (True, False) for j in enc_jobs if j[2] == s and j not in enc_now]  # streaming first
    n += len(now) + (0 if defer else enc.capture_jobs(later, dtype, progress))
    est.freeze()
    enc.freeze()
    if defer:  # streaming (the rows of a first chunk at higher concurrency) before full attention
        runner.deferred = ([est.deferred_job(f, s, dtype, r) for f, s, r in jobs if (f, s, r) not in now]
                           + [enc.deferred_job(j, dtype) for j in later])
    return n
