"""The flow stage: speech tokens in, mel frames out. model/ is the math, the rest are its runners (eager,
incremental, CUDA graph, fused Triton, TensorRT) behind :class:`~cosyvoice_fast.flow.stage.FlowStage`.
"""
