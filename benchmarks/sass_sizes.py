"""No GPU needed: the machine-code size of every Triton kernel a fused forward launches, compiled for an H100.

    python benchmarks/sass_sizes.py --out sass.json [--what estimator,decode,decode16] [--frames 200] [--rows 2]

Why: the nucleus draw, one program that runs each instruction once, took ~2 µs per 1000 SASS instructions
(BENCHMARKS.md, session 28), so code size is one thing to know about a kernel.  This tool shows how large the
kernels of a forward are, without a GPU.  It runs the forward at full CosyVoice2-0.5B size (seeded random weights,
bf16) on CPU under Triton's interpreter with every launch *recorded and skipped* (so no kernel runs and the
outputs are meaningless), the kernels choosing their tiles as on a GPU (:func:`gpu_choices`; host code that asks
``x.is_cuda`` still sees a CPU tensor, and programmatic dependent launch is turned on at compile time as the GPU
launches have it).  Then it compiles each distinct launch (kernel, argument types, constexprs, warps, stages) for
sm_90 with the Triton installed here and counts the SASS instructions with Triton's bundled ``cuobjdump``, which
also gives each kernel's registers per thread, spill stack and shared memory (a kernel that spills shows a
non-zero stack).  (The recording runs in a child process: under the interpreter the kernels are not compilable
objects.)

- ``estimator``: one fused estimator forward (:class:`~cosyvoice_fast.flow.kernels.estimator_fused.FusedEstimator`)
  of ``--rows`` rows x ``--frames`` frames, streaming (a first chunk's CFG pair by default);
- ``decode``: one fused decode step of one row through :func:`~cosyvoice_fast.llm.kernels.qwen2_decode.step_logits`;
- ``decode16``: the same for 16 rows (the looped projections and the looped head).

The Triton here may differ from the GPU machine's, and so may the code it emits: the sizes are for comparing
kernels with each other.  Registers differ most: the 16-row gate/up kernel compiled to 255 registers with a 56-byte
stack here (Triton 3.9) and to 76-92 registers without spills on the H100's Triton 3.6 (BENCHMARKS.md, session 33;
``device_ras_check.py`` reports the GPU's own counts for the norm-prologue kernels).  Results: per kernel
launches per forward, SASS instructions, instructions times launches, registers, stack and shared bytes; JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def record_launches() -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """Patch the interpreter so that every kernel launch is recorded as (jit function, named arguments,
    options) instead of run; returns the list the launches go to."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if warmup:
            return
        named = dict(zip(self.arg_names, args))
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        kwargs.pop("launch_pdl", None)
        named.update(kwargs)
        launches.append((self.fn, named, options))

    InterpretedFunction.run = run
    return launches


def _signature(fn: Any, named: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    import inspect

    import triton.language as tl

    sig, const = {}, {}
    for name, param in inspect.signature(fn).parameters.items():
        value = named.get(name, param.default)
        if param.annotation is tl.constexpr or param.annotation == "tl.constexpr":
            sig[name], const[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value is None:
            sig[name], const[name] = "constexpr", None
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return sig, const


def _portable(value: Any) -> Any:
    import triton.language as tl

    return {"tl_dtype": str(value)} if isinstance(value, tl.dtype) else value


def _restore(value: Any) -> Any:
    import triton.language as tl

    return tl.dtype(value["tl_dtype"]) if isinstance(value, dict) and "tl_dtype" in value else value


def compiled_size(module: str, name: str, sig: dict[str, str], const: dict[str, Any],
                  options: dict[str, Any]) -> dict[str, int]:
    """Kernel ``module.name`` compiled for sm_90 with this signature and these constexprs: its SASS instructions,
    registers per thread, stack (spill) bytes per thread and static shared bytes."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    if "PDL" in const:  # recorded on CPU, where launches never use programmatic dependent launch; the GPU does
        const = {**const, "PDL": True}
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): _restore(v) for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = Path("/tmp") / f"sass_sizes_{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    found = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", use)}
    return {"sass": len(re.findall(r"/\*[0-9a-f]{4,}\*/", out)), "registers": found.get("reg", -1),
            "stack": found.get("stack", -1), "shared": found.get("shared", -1)}


def estimator_launches(rows: int, frames: int) -> None:
    from cosyvoice_fast.config.model import full_config
    from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator
    from cosyvoice_fast.bench.estimator_profile import estimator_inputs
    from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder

    torch.manual_seed(0)
    est = CausalConditionalDecoder(full_config().flow.decoder).to(torch.bfloat16).eval()
    args = estimator_inputs(est.cfg, rows, frames, torch.bfloat16, device="cpu")
    with torch.inference_mode():
        FusedEstimator(est)(*args, True)


def decode_launches(rows: int = 1) -> None:
    from cosyvoice_fast.llm.kernels.qwen2_decode import step_logits
    from cosyvoice_fast.modeldir.synthetic import random_full_size_lm

    lm = random_full_size_lm(torch.bfloat16, device="cpu")
    cache = lm.new_cache(512, batch=rows)
    with torch.inference_mode():
        step_logits(lm.decoder, lm.speech_embedding.weight, lm.llm_decoder, torch.arange(7, 7 + rows)[:, None],
                    torch.arange(300, 300 + rows)[:, None], cache, kv_len=512)


def gpu_choices() -> None:
    """Make the kernel modules choose tiles and options as on a GPU: each asks ``interpreting()`` for its tile
    choice (the interpreter's tiles are taller, for speed), while ``estimator_common``'s own copy, which lets the
    kernels take CPU tensors, stays as it is."""
    import importlib
    import pkgutil

    import cosyvoice_fast.kernels as kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"cosyvoice_fast.kernels.{info.name}")
        if info.name != "estimator_common" and hasattr(module, "interpreting"):
            module.interpreting = lambda: False


def record(what: str, rows: int, frames: int, out: Path) -> None:
    """In this process (under the interpreter): run ``what``'s forward with launches recorded, write them."""
    gpu_choices()
    launches = record_launches()
    {"estimator": lambda: estimator_launches(rows, frames), "decode": decode_launches,
     "decode16": lambda: decode_launches(16)}[what]()
    recorded = []
    for fn, named, options in launches:
        sig, const = _signature(fn, named)
        recorded.append({"module": fn.__module__, "name": fn.__name__, "sig": sig,
                         "const": {k: _portable(v) for k, v in const.items()}, "options": options})
    out.write_text(json.dumps(recorded, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", default="estimator,decode")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)  # the child's file of recorded launches
    a = ap.parse_args()
    if a.record:
        record(a.what, a.rows, a.frames, Path(a.record))
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # this process compiles: kernels must be real jit functions
    import triton

    results: dict[str, Any] = {"triton": triton.__version__, "target": "sm_90", "rows": a.rows, "frames": a.frames}
    for what in a.what.split(","):
        rec = Path("/tmp") / f"sass_sizes_{os.getpid()}_{what}.json"
        subprocess.run([sys.executable, __file__, "--out", a.out, "--what", what, "--rows", str(a.rows), "--frames",
                        str(a.frames), "--record", str(rec)], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        launches = json.loads(rec.read_text())
        rec.unlink()
        count = Counter(json.dumps(r) for r in launches)  # keys in parameter order: the signature's order
        table = []
        for key, n in count.items():
            r = json.loads(key)
            size = compiled_size(r["module"], r["name"], r["sig"], r["const"], r["options"])
            table.append({"kernel": r["name"], "launches": n, **size, "sass_x_launches": size["sass"] * n,
                          "options": r["options"], "constexprs": r["const"]})
        table.sort(key=lambda r: -r["sass_x_launches"])
        results[what] = {"launches": len(launches), "variants": len(table),
                         "sass_x_launches": sum(r["sass_x_launches"] for r in table), "kernels": table}
        print(f"{what}: {len(launches)} launches of {len(table)} compiled variants")
        for r in table:
            print(f"  {r['kernel']:<28} x{r['launches']:<3} {r['sass']:>6} SASS {r['registers']:>4} reg "
                  f"{r['stack']:>5} stack  {r['options']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
