"""One GPU call for sampling inside the decode graph (``CudaGraphLLM(device_ras=True)``, :mod:`cosyvoice_fast.
kernels.philox`): are the recomputed variates ``exponential_``'s bits, and what does it buy per token?

    PYTHONUNBUFFERED=1 python benchmarks/device_ras_check.py --out $OUT [--budget S] [--rows 1,16,64]
        [--steps bits,profile,backend] [--ways ahead,ahead_torch_tail]

1. ``bits``: the kernel against ``exponential_`` of real CUDA generators (256 seeds and offsets, 25 and 6564
   elements): how many variates differ; where any do, how many equal ``-log(u)`` computed in torch instead;
2. ``profile``: the default stage's GPU kernels per decode round at each row count (``torch.profiler`` over
   30 rounds of graph replays): launches and µs per round by kernel name, so the decoder's share and the
   sampling tail's (LM head, softmax, nucleus draw, rule) can be read apart.  CUPTI's per-kernel times run
   higher than the rounds' wall time: compare shares, not sums;
3. ``backend``: the ``fused`` LLM at CosyVoice2-0.5B shapes (seeded random weights, bf16), built four ways:
   the RAS rule in the graph with each call's next step launched ahead (``ahead``, the default), the same with
   the sort-based torch nucleus draw instead of the one-launch kernel (``ahead_sort``), the rule in the graph
   without the step ahead (``graph``), the rule on the host (``host``), and the default with the sampling tail
   and the step-input merge/advance as torch ops instead of kernels (``ahead_torch_tail``), the default with
   the nucleus draw cut at its floor (``ahead_floor``: ``nucleus_topk.USE_FLOOR`` on), and the default with the
   step's embedding gather, final norm and speech head as torch ops (``before_session28``: ``Tiles.gemv_head``
   off), the default before session 31 (``before_session31``: a staging copy every step, the variates drawn
   by two Philox launches, the tokens copied to the host after each replay; the walk's and the fallback draw's
   changes are in both; ``floor_before_session31``: the same with the floor cut), the tokens copied instead of
   written into the host ring (``token_copy``), the rule kernels at 4 or 16 warps (``rule_warps4``,
   ``rule_warps16``), the default before session 32 (``before_session32``: steps of 3+ rows apply the final norm
   and the head as torch ops, ``Tiles.looped_head`` off) and the looped head at 16 or 64 columns a program
   (``head16``, ``head64``; 32 by default), and a step's start as torch's gather, cast and memset for every
   step (``torch_gather``) or as the gather kernel without programmatic dependent launch for GEMV steps
   (``gather_no_pdl``) or every step (``all_gather_no_pdl``), and the looped kernels with the norm prologue at
   8 warps (``norm_warps8``), with their norm pass rolled (``rolled_norm``, ``rolled_norm_warps8``), gate/up at 16
   columns a program (``gate_up16``), at the defaults (``norm_default``), or without programmatic dependent
   launch (``no_pdl``: the profile's kernel times without the early launches' waits), or with the looped q/k/v
   or gate/up projection split N ways over K (``qkv_splitN``, ``gate_up_splitN``), or with every norm taking a
   pass over its rows instead of the per-tile sums of squares (``norm_sums_off``); these ways combine with
   ``+`` (``qkv_split4+no_pdl``; so do the session-28/32 ways and ``head16``/``head64``): wall ms per decode
   round at each row count (150 forced tokens, sampling and the per-step sync included), RAS fallbacks per
   token, and the registers and spills of the norm-prologue kernels each way compiled anew.  ``--ways`` picks some;
   ``--steps`` picks steps (``profile_torch_tail``, ``profile_before31``, ``profile_before32``,
   ``profile_floor``, ``profile=WAY`` for any way: the profile of that way).

Results: ``OUT/device_ras_check.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from contextlib import contextmanager
from typing import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.steps import StepRunner, require_cuda  # noqa: E402

TOKENS, MAX_LEN = 150, 1024


def bits() -> dict:
    from cosyvoice_fast.llm.decode_feed import int64 as _int64
    from cosyvoice_fast.llm.kernels.philox import exponential_rows

    out: dict = {}
    for n in (25, 6564):
        pairs, refs = [], []
        for i in range(256):
            seed = (i * 0x9E3779B97F4A7C15 + 12345) % (1 << 64)
            g = torch.Generator(device="cuda").manual_seed(seed)
            g.set_offset(4 * (i * 977 % 5000))
            pairs.append((seed, g.get_offset()))
            refs.append(torch.empty(n, device="cuda").exponential_(generator=g))
        state = torch.tensor([[_int64(s) for s, _ in pairs], [o for _, o in pairs]], dtype=torch.long,
                             device="cuda")
        ref = torch.stack(refs)
        got = exponential_rows(state, torch.empty_like(ref))
        words = exponential_rows(state, torch.empty(ref.shape, dtype=torch.long, device="cuda"), raw=True)
        u = (words & 0xFFFFFFFF).float() * 2.0 ** -32 + 2.0 ** -33
        out[f"n{n}"] = {"variates": ref.numel(), "differ": int((got != ref).sum()),
                        "differ_precise_log": int((-torch.log(u) != ref).sum()),
                        "max_abs_diff": float((got - ref).abs().max())}
    return out


def _lm_and_request() -> tuple:
    """The full-size LM (seeded random weights, bf16) and one request's inputs: a 75-token prompt, 30 text ids."""
    from cosyvoice_fast.frontend.request import ModelInputs
    from cosyvoice_fast.modeldir.synthetic import random_full_size_lm

    text = torch.arange(100, 130, dtype=torch.int32)[None]
    inputs = ModelInputs(text_segments=[text], prompt_text=torch.arange(200, 220)[None],
                         llm_prompt_speech_token=torch.arange(75)[None] * 37 % 6561)
    return random_full_size_lm(torch.bfloat16), text, inputs


def _gather_way(way: str):  # noqa: ANN202
    """``qwen2_decode._gather`` for the ways that change a step's start: the torch ops for every step
    (``torch_gather``), or the gather kernel without programmatic dependent launch for GEMV steps
    (``gather_no_pdl``) or for every step (``all_gather_no_pdl``)."""
    import triton

    from cosyvoice_fast.llm.kernels import qwen2_gemv

    def gather(gemv: bool, tokens: torch.Tensor, table: torch.Tensor, resid: torch.Tensor,
               counters: torch.Tensor) -> None:
        if way == "torch_gather" or (way == "gather_no_pdl" and not gemv):
            resid.copy_(table[tokens])
            counters.zero_()
            return
        k, c = resid.shape[1], counters.numel()
        qwen2_gemv._embed_kernel[(tokens.numel(),)](tokens, table, resid, counters, k, c,
                                                    KP=triton.next_power_of_2(k), CP=triton.next_power_of_2(c),
                                                    PDL=False, num_warps=4, num_stages=1)
    return gather


_TILE_WAYS = {"before_session28": {"gemv_head": False, "looped_head": False},
              "before_session32": {"looped_head": False}, "head16": {"head": 16}, "head64": {"head": 64},
              "norm_warps8": {"norm_warps": 8}, "rolled_norm": {"rolled_norm": True},
              "rolled_norm_warps8": {"rolled_norm": True, "norm_warps": 8}, "gate_up16": {"gate_up": 16},
              "norm_default": {"norm_warps": 4, "rolled_norm": False}, "no_pdl": {"pdl": False},
              "norm_sums_off": {"norm_sums": False}}


def _tile_way(way: str) -> dict | None:
    """The ``Tiles`` fields of a way made of ``_TILE_WAYS`` entries and K splits joined by ``+``
    (``qkv_split1+norm_sums_off``), else None (a way that switches something else)."""
    fields: dict = {}
    for part in way.split("+"):
        name, _, n = part.rpartition("_split")
        if name in ("qkv", "gate_up") and n.isdigit():  # qkv_split4, gate_up_split2: K splits
            fields[f"{name}_split"] = int(n)
        elif part in _TILE_WAYS:
            fields.update(_TILE_WAYS[part])
        else:
            return None
    return fields


def _normed_kernels() -> dict:
    """Compiled variants so far of the looped kernels with the norm prologue, by kernel name and cache key:
    warps, registers per thread and spilled registers (Triton's ``n_regs``/``n_spills``, set at first launch)."""
    from cosyvoice_fast.llm.kernels import qwen2_head, qwen2_proj

    out: dict = {}
    for fn in (qwen2_proj._qkv_rope_kernel, qwen2_proj._gate_up_kernel, qwen2_head._head_kernel):
        for caches in getattr(fn, "device_caches", {}).values():
            for key, k in caches[0].items():
                out[f"{fn.__name__} {key}"] = {"kernel": fn.__name__, "num_warps": k.metadata.num_warps,
                                               "registers": getattr(k, "n_regs", None),
                                               "spills": getattr(k, "n_spills", None)}
    return out


@contextmanager
def _switches(way: str) -> Iterator[None]:
    """The module switches a way builds under (read while the graphs are captured)."""
    from cosyvoice_fast.llm import decode_feed, nucleus
    from cosyvoice_fast.llm.kernels import nucleus_topk, qwen2_decode, qwen2_proj, ras_rule

    tiles = qwen2_proj.TILES
    gather = qwen2_decode._gather
    if way in ("torch_gather", "gather_no_pdl", "all_gather_no_pdl"):
        qwen2_decode._gather = _gather_way(way)
    nucleus.USE_KERNEL = way != "ahead_sort"
    nucleus.USE_RULE_KERNELS = decode_feed.USE_KERNELS = way != "ahead_torch_tail"
    floor = nucleus_topk.USE_FLOOR
    nucleus_topk.USE_FLOOR = way in ("ahead_floor", "floor_before_session31")
    fields = _tile_way(way)
    if fields is not None:
        qwen2_proj.TILES = dataclasses.replace(tiles, **fields)
    warps = ras_rule.row_warps
    if way.startswith("rule_warps"):  # the rule and fallback-draw kernels at another warp count
        ras_rule.row_warps = lambda block, n=int(way[len("rule_warps"):]): n
    old31 = way in ("before_session31", "floor_before_session31")
    decode_feed.SKIP_UNCHANGED = nucleus.RULE_VARIATES = not old31
    decode_feed.USE_RING = not (old31 or way == "token_copy")
    try:
        yield
    finally:
        nucleus.USE_KERNEL = nucleus.USE_RULE_KERNELS = decode_feed.USE_KERNELS = True
        decode_feed.SKIP_UNCHANGED = nucleus.RULE_VARIATES = decode_feed.USE_RING = True
        qwen2_proj.TILES, nucleus_topk.USE_FLOOR, ras_rule.row_warps = tiles, floor, warps
        qwen2_decode._gather = gather


def backend(rows_list: list[int], results: dict, save, only: list[str] | None) -> None:  # noqa: ANN001
    from cosyvoice_fast.llm.fused import FusedLLM
    from cosyvoice_fast.config.model import full_config

    lm, text, inputs = _lm_and_request()

    ahead = {"device_ras": True, "decode_ahead": True}
    ways = {"ahead": ahead, "ahead_sort": ahead, "graph": {"device_ras": True, "decode_ahead": False},
            "host": {"device_ras": False}, "ahead_torch_tail": ahead, "ahead_floor": ahead,
            "before_session31": ahead, "floor_before_session31": ahead, "rule_warps4": ahead,
            "rule_warps16": ahead, "token_copy": ahead, "torch_gather": ahead, "gather_no_pdl": ahead,
            "all_gather_no_pdl": ahead}
    for way in only or list(ways):  # in the order asked for (repeats allowed: alternate to see drift)
        kwargs = ahead if _tile_way(way) is not None else ways[way]
        t = time.perf_counter()
        compiled = set(_normed_kernels())
        with _switches(way):
            stage = FusedLLM(lm, full_config(), slots=max(rows_list), max_len=MAX_LEN, progress=False, **kwargs)
        row: dict = {"way": way, "device_ras": stage.device_ras, "decode_ahead": stage.decode_ahead,
                     "build_s": round(time.perf_counter() - t, 1)}
        for rows in rows_list:
            states = [stage.new_state(inputs, text, torch.Generator(device="cuda").manual_seed(i), TOKENS, True)
                      for i in range(rows)]
            stage.prefill(states)
            torch.cuda.synchronize()
            fb0, steps = stage.fallback_draws, 0
            t0 = time.perf_counter()
            while not all(st.done for st in states):
                stage.decode([st for st in states if not st.done])
                steps += 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
            row[f"rows{rows}"] = {"ms_per_round": round(wall, 4), "steps": steps,
                                  "fallbacks_per_token": round((stage.fallback_draws - fb0) / (rows * steps), 3)}
            print(way, rows, row[f"rows{rows}"], flush=True)
        row["new_normed_kernels"] = [v for k, v in _normed_kernels().items() if k not in compiled]
        results["backend"].append(row)
        save()
        del stage
        torch.cuda.empty_cache()


def _union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _timeline(events: list) -> dict:
    """Rounds cut at each ``_read_kernel`` (a decode graph's first kernel): per round the period between two
    rounds' starts, the GPU's busy time in it (union of kernel and copy intervals), the graph's span (read to
    advance), the decoder's span (gather to the head, fused or cuBLAS) and the tail after the head; medians in
    µs.  Tells whether a round waits for the host (period > busy) and what the tail after the head costs."""
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events), key=lambda t: t[0])
    starts = [i for i, e in enumerate(ev) if e[2] == "_read_kernel"]
    rows: dict[str, list[float]] = {k: [] for k in ("period", "busy", "idle", "graph", "decoder", "tail",
                                                    "between_graphs")}
    sample: list = []
    for a, b in zip(starts, starts[1:]):
        rnd = ev[a:b]
        t0, t1 = rnd[0][0], ev[b][0]
        named = {n: (s, e) for s, e, n in rnd}
        adv = named.get("_advance_kernel")
        heads = [(s, e) for s, e, n in rnd if n in ("_head_gemv_kernel", "_head_kernel") or "gemm" in n.lower()
                 or "cutlass" in n]  # the fused heads, or cuBLAS's GEMMs: the head is the round's last of them
        head = max(heads, key=lambda se: se[1]) if heads else None
        busy = _union([(s, min(e, t1)) for s, e, _ in rnd])
        rows["period"].append(t1 - t0)
        rows["busy"].append(busy)
        rows["idle"].append(t1 - t0 - busy)
        if adv:
            rows["graph"].append(adv[1] - t0)
            rows["between_graphs"].append(t1 - adv[1])
        if head:
            first = min(s for s, _, n in rnd if n not in ("_read_kernel",) and not n.startswith("Memcpy")
                        and n != "_exponential_kernel")
            rows["decoder"].append(head[1] - first)
            if adv:
                rows["tail"].append(adv[1] - head[1])
        if not sample and head:
            sample = [[n[:40], round(s - head[1], 2), round(e - s, 2)] for s, e, n in rnd if e >= head[1] - 20]
            sample += [[ev[b][2][:40], round(ev[b][0] - head[1], 2), 0.0]]
    med = {k: round(sorted(v)[len(v) // 2], 2) for k, v in rows.items() if v}
    return {"rounds": len(starts) - 1, "median_us": med, "tail_of_one_round_us_from_head_end": sample}


def profile(rows_list: list[int], way: str = "ahead") -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from cosyvoice_fast.llm.fused import FusedLLM
    from cosyvoice_fast.config.model import full_config

    lm, text, inputs = _lm_and_request()
    with _switches(way):
        stage = FusedLLM(lm, full_config(), slots=max(rows_list), max_len=MAX_LEN, progress=False)
    out: dict = {}
    rounds = 30
    for rows in rows_list:
        states = [stage.new_state(inputs, text, torch.Generator(device="cuda").manual_seed(i), TOKENS, True)
                  for i in range(rows)]
        stage.prefill(states)
        for _ in range(10):
            stage.decode(states)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                stage.decode(states)
            torch.cuda.synchronize()
        by: dict[str, list] = {}
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        for e in gpu:
            v = by.setdefault(e.name[:60], [0, 0.0])
            v[0] += 1
            v[1] += e.time_range.end - e.time_range.start
        top = sorted(by.items(), key=lambda kv: -kv[1][1])
        out[f"rows{rows}"] = {
            "kernels_per_round": round(sum(v[0] for v in by.values()) / rounds, 1),
            "kernel_us_per_round": round(sum(v[1] for v in by.values()) / rounds, 1),
            "by_name_per_round": [[k, round(v[0] / rounds, 2), round(v[1] / rounds, 2)] for k, v in top[:40]],
            "timeline": _timeline(gpu)}
        print(rows, out[f"rows{rows}"]["kernels_per_round"], out[f"rows{rows}"]["kernel_us_per_round"], flush=True)
        for st in states:
            stage.release(st)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory; results go to OUT/device_ras_check.json")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole script")
    ap.add_argument("--rows", default="1,16,64", help="row counts of the backend step (comma-separated)")
    ap.add_argument("--steps", default="bits,profile,backend",
                    help="comma-separated: bits, profile, profile_torch_tail, profile_before, "
                    "profile_before31, profile_before32, profile_floor, profile=WAY (any way), backend")
    ap.add_argument("--ways", default=None, help="comma-separated ways of the backend step (default: all)")
    a = ap.parse_args()
    require_cuda("device_ras_check.py")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": []}
    runner = StepRunner(Path(a.out) / "device_ras_check.json", results, step_timeout=300, budget_s=a.budget)
    rows, steps = [int(r) for r in a.rows.split(",")], a.steps.split(",")
    ways = a.ways.split(",") if a.ways else None
    if "bits" in steps:
        runner.run("bits", bits)
    if "profile" in steps:
        runner.run("profile", lambda: profile(rows))
    if "profile_torch_tail" in steps:
        runner.run("profile_torch_tail", lambda: profile(rows, "ahead_torch_tail"))
    if "profile_before" in steps:
        runner.run("profile_before", lambda: profile(rows, "before_session28"))
    if "profile_before31" in steps:
        runner.run("profile_before31", lambda: profile(rows, "before_session31"))
    if "profile_before32" in steps:
        runner.run("profile_before32", lambda: profile(rows, "before_session32"))
    if "profile_floor" in steps:
        runner.run("profile_floor", lambda: profile(rows, "ahead_floor"))
    for step in steps:
        if step.startswith("profile="):  # the profile of any way
            runner.run(f"profile_{step[8:]}", lambda way=step[8:]: profile(rows, way))
    if "backend" in steps:
        runner.run("backend", lambda: backend(rows, results, runner.save, ways), store=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
