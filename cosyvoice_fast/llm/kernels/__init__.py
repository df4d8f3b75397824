"""Triton kernels of the fused LLM backend and the graph-capturable sampler (CPU runs them with TRITON_INTERPRET=1).
"""
