"""``python -m cosyvoice_fast warmup``: build the chosen backends once, so their kernels land in the compile cache.

Run it where the image is built (a Docker ``RUN`` step on the serving GPU type, with the same ``--cache-dir``)
or once on a rented box: every later start on that GPU, driver and library versions loads the compiled kernels
instead of compiling them (:mod:`~cosyvoice_fast.kernels.compile_cache`).  It loads the model, builds each
backend's stages (every start-up graph is captured, which is when Triton compiles), runs one short request per
backend, and prints the start-up phases with their seconds (``--json`` writes them to a file too).  With background
capture (``--background-capture``, off by default) it then waits for the graphs left for after ready and prints
when they were all captured (``all graphs``, seconds after the process started).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cosyvoice_fast.config.flags import add_cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cli_args(p, parts=("model", "device", "engine"))
    p.add_argument("--backends", default=None,
                   help="comma-separated presets or llm:flow:vocoder triples to build (default: cudagraph on a GPU, "
                        "the app's default there; eager on a CPU)")
    p.add_argument("--json", metavar="FILE", help="also write the start-up phases and cache path as JSON here")
    p.add_argument("--background-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the background captures after ready (default 600)")


def cmd_warmup(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from cosyvoice_fast.config.flags import from_cli_args
    from cosyvoice_fast.config.presets import parse_backend
    from cosyvoice_fast.engine.startup import process_age_s
    from cosyvoice_fast.serving.service import load_service

    run = from_cli_args(a)
    names = a.backends or ("cudagraph" if run.device.type == "cuda" else "eager")
    backends = [parse_backend(n.strip(), run.dtype, "--backends") for n in names.split(",") if n.strip()]
    if not backends:
        print("error: --backends names no backend; e.g. --backends cudagraph,fused", file=sys.stderr)
        return 2
    kw = run.service_kwargs()
    kw["backend"] = backends[0]
    svc = load_service(**kw, speaker_cache_dir=None, progress=False)
    try:
        svc.start_warmup(background=False, backends=[replace(b, dtype=run.dtype) for b in backends])
        snap = svc.startup.snapshot()
        cache = svc.startup.cache_path
        bg = svc.engine.background
        finished = bg.join(a.background_timeout)
        age = process_age_s()
        all_s = round(age if age is not None else snap["elapsed_s"] + (bg.seconds or 0.0), 2) if finished else None
        out = {"backends": [f"{b.llm}:{b.flow}:{b.vocoder}" for b in backends], "cache_dir": cache,
               "startup": snap, "warmup_error": svc.warmup_error, "ready_s": snap["elapsed_s"], "all_graphs_s": all_s,
               "background": {"captured": bg.done, "planned": bg.total, "failed": bg.failed, "seconds": bg.seconds,
                              "finished": finished}}
        for p in snap["phases"]:
            print(f"{p['name']:<18}{p['seconds']:8.1f} s")
        print(f"{'total':<18}{snap['elapsed_s']:8.1f} s  ({snap['graphs_captured']} graphs captured, "
              f"{snap['kernels_compiled']} kernels compiled; cache: {cache})")
        if bg.total:
            print(f"{'all graphs':<18}{all_s if all_s is not None else float('nan'):8.1f} s  ({bg.done}/{bg.total} "
                  f"captured in the background in {bg.seconds or 0.0:.1f} s, {bg.failed} failed"
                  + ("" if finished else f"; not finished after {a.background_timeout:.0f} s") + ")")
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        svc.close()
    return 1 if svc.warmup_error else 0
