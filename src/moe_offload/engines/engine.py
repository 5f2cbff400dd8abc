"""The engines a plan is exported for: their names as `--engine` takes them and as prose says them, and the
tiers they all see as "offloaded" (none of them has a disk tier: host and disk are both off the GPU).
"""

from __future__ import annotations

from enum import Enum

from ..planning.placement import Tier

OFFLOADED = (Tier.HOST.value, Tier.DISK.value)


class Engine(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMA_CPP = "llama.cpp"


ENGINES = tuple(e.value for e in Engine)
LABELS = {Engine.VLLM: "vLLM", Engine.SGLANG: "SGLang", Engine.LLAMA_CPP: "llama.cpp"}
