"""The speech LM stage: text and prompt in, speech tokens out. model/ is the math, the rest are its runners (eager,
CUDA graph, fused Triton, TensorRT-LLM) behind :class:`~cosyvoice_fast.llm.stage.LLMStage`.
"""
