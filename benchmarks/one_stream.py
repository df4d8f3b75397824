"""The service and requests of the bench's concurrency-1 workload, for the scripts that time single streams
(``ttfb_trace.py``, ``host_path_check.py``, ``first_chunk_pause_ab.py``, ``host_staging_ab.py``), and the
alternating same-process A/B the last two run (:func:`ab_rounds`).

They take the bench's model, device and engine flags plus its workload flags after ``--`` and build requests
exactly as ``python -m cosyvoice_fast.bench.engine_bench`` does (seeded synthetic token ids, a new voice per request, EOS
ignored), so their numbers line up with the bench's c1 row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

#: the bench's workload flags and defaults
WORKLOAD = (("--prompt-tokens", 75), ("--text-tokens", 30), ("--gen-tokens", 150), ("--token-hop-len-first", 25),
            ("--pre-lookahead-len", 3))


def script_args(argv: Sequence[str], doc: str | None, prog: str,
                add: Callable[[argparse.ArgumentParser], None]) -> tuple[argparse.Namespace, list[str], Path]:
    """Split ``argv`` at ``--``: the script's own flags before it (``--out``, plus what ``add`` declares), the
    bench's after it.  Without ``--`` the script exits with its docstring.  Creates ``--out``."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit(doc)
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--out", required=True)
    add(ap)
    mine = ap.parse_args(argv[:split])
    out = Path(mine.out)
    out.mkdir(parents=True, exist_ok=True)
    return mine, argv[split + 1:], out


@dataclass
class OneStream:
    """A loaded service, the parsed bench flags (``args``) and ``make(seed)`` -> the bench's request."""

    svc: Any
    args: argparse.Namespace
    backend: Any
    make: Callable[[int], Any]


def load(bench_argv: Sequence[str], prog: str) -> OneStream:
    """Load the service the bench flags describe (``--backends`` names one preset, default ``fused``)."""
    from cosyvoice_fast.bench import engine_bench as bench
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args
    from cosyvoice_fast.config.model import StreamParams
    from cosyvoice_fast.frontend.request import SynthesisRequest
    from cosyvoice_fast.serving.service import load_service

    ap = argparse.ArgumentParser(prog=f"{prog} (bench flags after --)")
    add_cli_args(ap, parts=("model", "device", "engine"))
    ap.add_argument("--backends", default="fused")
    for flag, default in WORKLOAD:
        ap.add_argument(flag, type=int, default=default)
    a = ap.parse_args(list(bench_argv))
    a.same_voice, a.gpu_busy = False, False  # what bench.bench_config reads besides the workload
    run = from_cli_args(a, ap)
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    backend = bench.parse_backend(a.backends, run.dtype)
    params = StreamParams(token_hop_len_first=a.token_hop_len_first, pre_lookahead_len=a.pre_lookahead_len)
    cfg = svc.models.config

    def make(seed: int) -> SynthesisRequest:
        return SynthesisRequest(inputs=bench.synthetic_inputs(cfg, a.prompt_tokens, a.text_tokens, seed=seed),
                                seed=seed, stream=True, stream_params=params, backend=backend,
                                max_tokens=a.gen_tokens, ignore_eos=True)

    return OneStream(svc, a, backend, make)


def ab_flags(ap: argparse.ArgumentParser) -> None:
    """The A/B scripts' own flags: how many alternating rounds, and requests per measurement."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)


def stage_ab(argv: Sequence[str], doc: str | None, prog: str, stage: str, backend: str,
             add: Callable[[argparse.ArgumentParser], None] | None = None
             ) -> tuple[argparse.Namespace, Path, OneStream, Any, Any]:
    """The start of a same-process A/B of one stage's implementations (``decode_tail_ab``, ``vocoder_ab``): the
    script's flags (:func:`ab_flags`, plus what ``add`` declares), its output folder, the loaded service, the
    engine's stage cache, and the stage set the requests run on (built now).  Refuses a preset whose ``stage``
    is not ``backend``."""
    def flags(ap: argparse.ArgumentParser) -> None:
        ab_flags(ap)
        if add is not None:
            add(ap)

    mine, bench_argv, out = script_args(argv, doc, prog, flags)
    one = load(bench_argv, prog)
    got = getattr(one.backend, stage)
    if got != backend:
        raise SystemExit(f"{prog} compares {backend!r} {stage} stages; --backends gave {stage} {got!r}")
    return mine, out, one, one.svc.engine._stage_sets, one.svc.engine.stages(one.backend)


def swap_rounds(one: OneStream, target: Any, attr: str, variants: dict[str, Any], rounds: int, requests: int,
                out_file: Path, argv: Sequence[str]) -> dict[str, Any]:
    """:func:`ab_rounds` over variants that differ in one attribute of ``target`` (a stage set's ``llm`` or
    ``vocoder``): each variant sets ``target.<attr>`` to its value."""
    def use(value: Any) -> Callable[[], None]:
        return lambda: setattr(target, attr, value)

    return ab_rounds(one, {name: use(value) for name, value in variants.items()}, rounds, requests, out_file, argv)


def ab_rounds(one: OneStream, variants: dict[str, Callable[[], None]], rounds: int, requests: int, out_file: Path,
              argv: Sequence[str]) -> dict[str, Any]:
    """Alternate ``variants`` (name -> a function that patches that variant in; the last one should be the
    shipped code) over ``rounds`` rounds of the bench's c1 measurement (``bench.bench_config``: a warm-up wave,
    then ``requests`` requests one after another), the order reversed every other round.  Writes
    ``out_file`` after each round; returns the results, with each variant's median TTFB p50.  Closes the
    service and leaves the last variant patched in."""
    import json
    import statistics

    import torch

    from cosyvoice_fast.bench import engine_bench as bench

    svc, a, backend = one.svc, one.args, one.backend
    dev = svc.models.device
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "args": list(argv), "rounds": []}
    names = list(variants)
    try:
        for r in range(rounds):
            row: dict[str, Any] = {}
            for name in names if r % 2 == 0 else names[::-1]:
                variants[name]()
                agg = bench.bench_config(svc.engine, backend, 1, requests, a)
                row[name] = {k: v for k, v in agg.items() if k.startswith("ttfb") or k in (
                    "llm_ms_per_token", "audio_s_per_s", "underruns", "n", "queue_chunk_ms")}
                print(f"round {r} {name}: TTFB p50 {agg['ttfb_ms']['p50']:.2f} p95 {agg['ttfb_ms']['p95']:.2f}; "
                      + ", ".join(f"{k[5:-3]} {v['p50']:.2f}" for k, v in agg.items()
                                  if k.startswith("ttfb.") and isinstance(v, dict)), flush=True)
            results["rounds"].append(row)
            out_file.write_text(json.dumps(results, indent=1, default=str))
    finally:
        variants[names[-1]]()
        svc.close()
    for name in names:
        p50 = [row[name]["ttfb_ms"]["p50"] for row in results["rounds"]]
        results[f"{name}_ttfb_p50_median"] = statistics.median(p50)
        print(f"{name}: TTFB p50 per round {', '.join(f'{x:.2f}' for x in p50)}")
    out_file.write_text(json.dumps(results, indent=1, default=str))
    return results
