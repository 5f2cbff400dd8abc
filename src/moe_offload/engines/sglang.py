"""A plan in SGLang's options: `--cpu-offload-gb X` (OffloaderV1).

SGLang shares vLLM's decoder layers and walks them as vLLM does (vllm.layer_walk), with no selectors; what is
its own is how it reads what it offloaded: every offloaded parameter of a layer is copied to the GPU in full
at each forward, so a step reads all of its bytes, routed experts included.
"""

from __future__ import annotations

from dataclasses import replace

from ..planning.placement import Plan, PlannedTensor
from .engine import Engine
from .vllm import layer_walk

SGLANG_READS = ("SGLang's --cpu-offload-gb offloads decoder-layer parameters in declaration order (it has no "
                "selectors) and copies them to the GPU in full at every forward, so each step reads all "
                "their bytes, routed experts included")


def sglang_options(plan: Plan) -> tuple[list[str], set[str], list[str]]:
    """SGLang's options for `plan`: (args, the in-memory tensors they send to host memory, notes)."""
    return layer_walk(plan, Engine.SGLANG, selectors_allowed=False, reads=SGLANG_READS)


def read_in_full(t: PlannedTensor) -> PlannedTensor:
    """An offloaded tensor as SGLang reads it: copied to the GPU in full at every forward, no expert axis to
    read in part, so the accounting reads every byte of it per step."""
    return replace(t, experts=None, top_k=None)
