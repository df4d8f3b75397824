"""Triton kernels of the ``fused`` backend (CUDA; on CPU they run through ``TRITON_INTERPRET=1``)."""
