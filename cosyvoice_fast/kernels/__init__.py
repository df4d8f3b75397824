"""Triton kernels of the ``fused`` backends (one module per fused block; CPU runs them with TRITON_INTERPRET=1)."""
