"""Stage backends: eager (the reference), cudagraph, tensorrt (flow estimator), trtllm (speech LM)."""

from __future__ import annotations

import copy

import torch

from ..config import BackendConfig
from .base import StageSet

def build_stage_set(models, config: BackendConfig) -> StageSet:  # noqa: ANN001 - LoadedModels (import cycle)
    """Instantiate the stage implementations ``config`` names, over ``models`` (cast copies if dtype differs)."""
    from . import eager

    dtype = config.torch_dtype
    llm, flow = models.llm, models.flow
    if dtype != models.dtype:
        if models.device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"dtype {config.dtype} is for GPUs; on CPU use fp32")
        llm = copy.deepcopy(models.llm).to(dtype)
        flow = copy.deepcopy(models.flow).to(dtype)
    if config.llm == "eager":
        llm_stage = eager.EagerLLM(llm, models.config)
    elif config.llm == "cudagraph":
        from .cudagraph_llm import CudaGraphLLM

        llm_stage = CudaGraphLLM(llm, models.config)
    else:
        from .trtllm import TrtLlmLLM

        llm_stage = TrtLlmLLM(llm, models.config)
    if config.flow == "eager" and not config.incremental:
        flow_stage = eager.EagerFlow(flow, models.config)
    elif config.flow in ("eager", "incremental"):
        from ..runtime.flow_state import IncrementalFlow

        flow_stage = IncrementalFlow(flow, models.config)
    elif config.flow == "cudagraph":
        from .cudagraph_flow import CudaGraphFlow

        flow_stage = CudaGraphFlow(flow, models.config, incremental=config.incremental)
    elif config.flow == "fused":
        from .fused_flow import FusedFlow

        flow_stage = FusedFlow(flow, models.config)
    else:
        from .tensorrt_flow import TensorRTFlow

        flow_stage = TensorRTFlow(flow, models.config)
    if config.vocoder == "eager":
        voc_stage = eager.EagerVocoder(models.hift)
    else:
        from .cudagraph_vocoder import CudaGraphVocoder

        voc_stage = CudaGraphVocoder(models.hift)
    return StageSet(config=config, llm=llm_stage, flow=flow_stage, vocoder=voc_stage)
