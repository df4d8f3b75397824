"""Triton kernels of the fused vocoder backend."""
