"""The service and requests of the bench's concurrency-1 workload, for the scripts that time single streams
(``ttfb_trace.py``).

They take the bench's model, device and engine flags plus its workload flags after ``--`` and build requests
exactly as ``python -m cosyvoice_fast.bench`` does (seeded synthetic token ids, a new voice per request, EOS
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
    bench's after it.  Without ``--`` the script exits with its docstring: status 0 for ``-h``/``--help``, else 1.
    Creates ``--out``."""
    argv = list(argv)
    if "--" not in argv:
        exit_with_doc(doc, argv)
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--out", required=True)
    add(ap)
    mine = ap.parse_args(argv[:split])
    out = Path(mine.out)
    out.mkdir(parents=True, exist_ok=True)
    return mine, argv[split + 1:], out


def exit_with_doc(doc: str | None, argv: Sequence[str]) -> None:
    """Print ``doc`` and exit: 0 when ``argv`` asks for help (``-h``/``--help``), 1 otherwise (a usage error)."""
    if "-h" in argv or "--help" in argv:
        print(doc)
        raise SystemExit(0)
    raise SystemExit(doc)


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
    from cosyvoice_fast.config.presets import parse_backend
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args
    from cosyvoice_fast.config.stream import StreamParams
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
    backend = parse_backend(a.backends, run.dtype)
    params = StreamParams(token_hop_len_first=a.token_hop_len_first, pre_lookahead_len=a.pre_lookahead_len)
    cfg = svc.models.config

    def make(seed: int) -> SynthesisRequest:
        return SynthesisRequest(inputs=bench.synthetic_inputs(cfg, a.prompt_tokens, a.text_tokens, seed=seed),
                                seed=seed, stream=True, stream_params=params, backend=backend,
                                max_tokens=a.gen_tokens, ignore_eos=True)

    return OneStream(svc, a, backend, make)


if __name__ == "__main__":
    import sys

    exit_with_doc(__doc__, sys.argv[1:])
