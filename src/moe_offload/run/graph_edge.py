"""The streamed experts step as one opaque node of a compiled decode step.

A CPU-only disk-tier decode step streams its experts (streamed.py): which experts, where their rows lie and
the reader threads are decided as it runs, so torch.compile cannot trace it. Marked `torch.compiler.disable`
and called from inside the decoder layers, it broke the graph inside transformers' loop over the layers, where
dynamo cannot resume ("graph break in loop": the frame is skipped): the model's body then ran eagerly and
`--compile` gained nothing on the disk tier (Qwen3-30B-A3B's layer x 8, two threads: 119 ms a token compiled,
116 eager).

So a runtime whose experts modules can stream registers one custom operator of its own (torch.library, in a
namespace of its own, released with the runtime):

    <namespace>::experts(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, int module) -> Tensor

Its CPU implementation is streamed_step on experts module number `module` of this runtime; its fake
implementation gives the output's shape and dtype ([T, H] of hidden's). Traced, a streamed experts call is one
node of the graph, its arguments computed before it and its output used after it: the attention, norms and
router of every layer, the final norm and the LM head compile as one graph around those nodes, as the resident
model's do. Eager calls never go through the operator; the arithmetic is the same call either way.

The dispatcher holds the implementation; it reaches the runtime's modules only through a weak reference, so a
model dropped without close() is still freed (the library's own finalizer then removes the operator).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .streamed import streamed_step

_SERIAL = itertools.count()   # one namespace per registry: torch.ops caches operators by name


class GraphEdges:
    """The experts modules of one runtime whose streamed step a compiled graph calls as an operator."""

    def __init__(self):
        self.namespace = f"moe_offload_edge{next(_SERIAL)}"
        self._steps: list[tuple] = []       # (ExpertsState, experts module), by the index the graph names
        self._lib = torch.library.Library(self.namespace, "DEF")
        self._lib.define("experts(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, int module) -> Tensor")
        ref = weakref.ref(self)

        def run(hidden, top_k_index, top_k_weights, module):
            edges = ref()
            if edges is None:
                raise RuntimeError("moe-offload: a compiled step called the experts of a closed runtime")
            state, mod = edges._steps[module]
            return streamed_step(state, mod, hidden, top_k_index, top_k_weights)

        def fake(hidden, top_k_index, top_k_weights, module):
            return hidden.new_empty(hidden.shape)

        self._lib.impl("experts", run, "CPU")
        torch.library.register_fake(f"{self.namespace}::experts", fake, lib=self._lib)
        self._op = getattr(getattr(torch.ops, self.namespace), "experts").default

    def add(self, state, module) -> int:
        """Register an experts module; returns the index its graph nodes name it by."""
        self._steps.append((state, module))
        return len(self._steps) - 1

    def clear(self) -> None:
        self._steps.clear()

    def experts(self, index: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The streamed step of experts module `index` as the operator: traced, one node of the graph."""
        return self._op(hidden, top_k_index, top_k_weights, index)

    def close(self) -> None:
        self._steps.clear()
        self._lib = None     # the library's finalizer removes the operator
