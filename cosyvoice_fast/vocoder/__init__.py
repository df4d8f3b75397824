"""The vocoder stage: mel in, waveform out, streamed with caches and cross-fades. model/ is HiFT's math; runners are
eager, CUDA graph and fused Triton.
"""
