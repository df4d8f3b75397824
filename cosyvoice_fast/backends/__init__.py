"""Stage backends: eager (the reference), cudagraph, tensorrt (flow estimator), trtllm (speech LM)."""

from __future__ import annotations

import copy

import torch

from ..config import BackendConfig
from .base import StageSet

def build_stage_set(models, config: BackendConfig, engine_config=None) -> StageSet:  # noqa: ANN001 - LoadedModels, EngineConfig
    """Instantiate the stage implementations ``config`` names, over ``models`` (cast copies if dtype differs);
    ``engine_config`` (an :class:`~cosyvoice_fast.engine_config.EngineConfig`) sizes the graph runners."""
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

        kw = {}
        if engine_config is not None:
            kw = {"slots": engine_config.llm_slots or engine_config.max_streams, "max_len": engine_config.max_context}
        llm_stage = CudaGraphLLM(llm, models.config, **kw)
    else:
        from .trtllm import TrtLlmLLM

        llm_stage = TrtLlmLLM(llm, models.config)
    if config.flow == "eager" and not config.incremental:
        flow_stage = eager.EagerFlow(flow, models.config)
    elif config.flow in ("eager", "incremental"):
        from .incremental_flow import IncrementalFlow

        flow_stage = IncrementalFlow(flow, models.config)
    elif config.flow == "cudagraph":
        from .cudagraph_flow import CudaGraphFlow

        kw = {}
        if engine_config is not None:
            kw = {"buckets": engine_config.flow_buckets, "rows": engine_config.flow_rows,
                  "capture_at_start": engine_config.capture_at_start}
        flow_stage = CudaGraphFlow(flow, models.config, incremental=config.incremental, **kw)
    else:
        from .tensorrt_flow import TensorRTFlow

        flow_stage = TensorRTFlow(flow, models.config)
    if config.vocoder == "eager":
        voc_stage = eager.EagerVocoder(models.hift)
    else:
        from .cudagraph_vocoder import CudaGraphVocoder

        voc_stage = CudaGraphVocoder(models.hift)
    return StageSet(config=config, llm=llm_stage, flow=flow_stage, vocoder=voc_stage)
