"""Run ``python -m cosyvoice_fast.bench.engine_bench`` with keyword arguments forced on a backend class: a same-call A/B of a
constructor option that has no command-line flag (it is a backend detail, not a capacity setting).

    python benchmarks/bench_with.py cudagraph_llm.CudaGraphLLM decode_ahead=false -- --synthetic full ...

Each ``NAME=VALUE`` after the class is passed to every construction of ``cosyvoice_fast.engine.stages.<module>.<class>``
(subclasses included); values are parsed as Python literals where they are one (``false``/``true`` too),
else kept as strings.  Everything after ``--`` goes to the bench unchanged.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


_NAMED = {"true": True, "false": False, "none": None}


def _value(text: str) -> Any:
    if text.lower() in _NAMED:
        return _NAMED[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") < 1:
        raise SystemExit(__doc__)
    split = argv.index("--")
    target, pairs, bench_args = argv[0], argv[1:split], argv[split + 1:]
    module_name, _, class_name = target.rpartition(".")
    cls = getattr(importlib.import_module(f"cosyvoice_fast.engine.stages.{module_name}"), class_name)
    forced = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE after the class, got {pair!r}")
        forced[name] = _value(value)
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, **forced})

    cls.__init__ = init
    print(f"bench_with: {target}({', '.join(f'{k}={v!r}' for k, v in forced.items())})", flush=True)
    sys.argv = ["cosyvoice_fast.bench.engine_bench", *bench_args]
    runpy.run_module("cosyvoice_fast.bench.engine_bench", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
