"""Named backend presets and the one parser of a backend name, shared by the benchmark, the Ray Serve deployment
and anything else that lets a person choose a backend by name.

A name is either a preset (``fused`` means LLM, flow and vocoder all fused) or an explicit ``llm:flow:vocoder``
triple, e.g. ``cudagraph:eager:cudagraph`` to measure one stage's backend against the others held fixed.  It lives
in ``config/`` so production code (serving) does not depend on the benchmark to read a backend name.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError

BACKEND_PRESETS: Mapping[str, BackendConfig] = MappingProxyType({
    "eager": BackendConfig(incremental=False),  # upstream's scheme: the reference every speed-up is against
    "eager-incremental": BackendConfig(),
    "cudagraph": BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph"),
    "cudagraph-recompute": BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", incremental=False),
    "fused": BackendConfig(llm="fused", flow="fused", vocoder="fused"),  # Triton kernels in the graphs
    "fused-recompute": BackendConfig(llm="fused", flow="fused", vocoder="fused", incremental=False),
    "tensorrt": BackendConfig(llm="cudagraph", flow="tensorrt", vocoder="cudagraph"),
    "trtllm": BackendConfig(llm="trtllm", flow="tensorrt", vocoder="cudagraph"),
})


def parse_backend(name: str, dtype: str, field: str = "--backends") -> BackendConfig:
    """A preset name (``eager``, ``cudagraph``, ...) or an explicit ``llm:flow:vocoder`` triple, in ``dtype``.  A bad
    name raises :class:`ConfigError` naming ``field`` (the flag or option it came from), so the person sees which
    of their inputs to change."""
    if name in BACKEND_PRESETS:
        p = BACKEND_PRESETS[name]
        return BackendConfig(llm=p.llm, flow=p.flow, vocoder=p.vocoder, dtype=dtype, incremental=p.incremental)
    parts = name.split(":")
    if len(parts) != 3:
        raise ConfigError(f"{field} {name!r} is unknown: use a preset ({', '.join(BACKEND_PRESETS)}) "
                          "or llm:flow:vocoder, e.g. cudagraph:eager:cudagraph")
    return BackendConfig(llm=parts[0], flow=parts[1], vocoder=parts[2], dtype=dtype)
