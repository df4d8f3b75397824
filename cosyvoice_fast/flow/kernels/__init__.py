"""Triton kernels of the fused flow backend (estimator and encoder)."""
