"""Programmatic dependent launch (PDL) for the fused Triton kernels, shared by the LLM and estimator kernels.

Inside a CUDA graph a chain of small kernels still pays a launch gap and a cold prologue per kernel: the next
kernel's programs only start once the previous grid has finished.  With PDL (Hopper and later) a kernel is
launched while the previous one drains; its programs run their prologue (index math, loads of weights, which
never depend on the previous kernel) and park at ``gdc_wait`` until the previous grid's writes are visible.
Every kernel that uses it must read no activation and write nothing before :func:`pdl_start`: a buffer it
writes may still be read by the kernel before it (the graph's memory pool reuses freed buffers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # not in every Triton build, and never in the interpreter
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton build
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel's writes are visible (nothing is read before this), then let the
    next kernel launch and park at its own wait while this one runs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_options(enabled: bool, t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking a ``PDL`` constexpr: PDL only when ``enabled`` and ``t`` is on CUDA
    (the interpreter has none)."""
    pdl = enabled and t.is_cuda
    if pdl and gdc_wait is None:
        raise RuntimeError("programmatic dependent launch needs a Triton build with "
                           "triton.language.extra.cuda.gdc_wait (>= 3.3); turn it off or upgrade Triton")
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
