"""Fused experts modules as the runtime drives them: which experts a call reads, and from where.

transformers' experts registry (`ALL_EXPERTS_FUNCTIONS`) lets the function registered here
see `top_k_index` before any expert weight is touched. It is installed on every experts
module of a loaded model, so it also serves as the routing observer (state.RoutedCall, for
`profile`), offloaded or not. A module with nothing offloaded runs the class's own eager
forward unchanged.

For a module with offloaded experts only the experts the router selected are read:

- whole tensors on the host, uva backend: the kernels index the selected experts of
  the host view in place; the distinct experts are charged on the device (state.picked_bytes,
  from the plan's accounting) and read back with the counts, never during the step;
- otherwise (prefetch, or any tensor split between tiers): the U selected experts are
  gathered, in ascending expert order, into reused buffers, each from the stack that holds
  it (a split tensor's resident stack on the device, its host stack over the link), and the
  routing is renumbered 0..U-1. Where each selected expert of each tensor comes from, and the
  counter it charges, is the layer step's read plan (read_plan.py), charged once and carried out
  by one executor (read_executor.py). The eager loop then visits the same experts in the same
  order with the same values: bit-identical arithmetic, whatever subset lies on the host.

A module whose experts are held quantized (FP8, MXFP4: quant_weights.py) always takes the gathering
path, resident or not: its values and scales are gathered as stored, then exactly the selected experts
are dequantized on the device into reused buffers, and the eager loop runs on those.

Tensors on the disk tier (disk_tier.py) always take the gathering path: the selected experts are read from
the checkpoint into the same reused buffers, counted in the runtime's disk counter. On a cpu device a decode step
of the CPU kernels computes each expert as soon as its rows have landed, while the next are read (streamed.py).

What computes the selected experts is the runtime's `ExpertsCompute` (compute.py): the class's eager loop
(`experts="eager"`, the model's own arithmetic), one grouped gather-GEMV kernel per projection
(`experts="grouped"`) or the CPU kernels on the stored format (`experts="fused"`: quantized experts are then
neither gathered for dequantizing nor dequantized), over the module's stacks in place or the gathered buffers with renumbered ids. The
gathering is data-dependent and always runs eagerly (`ExpertsState.gather`): under a compiled decode step it
is where the graph breaks.

Link bytes count only the selected experts that are on the host. With a device-side expert cache
(device_cache.py), a decode step gathers every offloaded tensor the same way, each selected expert
from its cache pages (a hit: no link bytes), its resident stack, or the host (a miss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch
import torch.nn as nn

from .grouped import original_forward
from .chunked import chunked_step, too_big
from .streamed import streamed_step, streams
from .read_executor import execute
from .read_plan import InPlaceRead, plan_step
from .state import RunState, Selected
from ..storage.host import ExpertSplit

EXPERTS_IMPL = "moe_offload"


def is_experts_module(module: nn.Module) -> bool:
    return hasattr(type(module).forward, "__wrapped__") and "Experts" in type(module).__name__


class _StagedExperts:
    """The experts module as its eager forward sees it, with some tensors replaced by gathered copies."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], num_experts: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "num_experts", num_experts)

    def __getattr__(self, name):
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        return getattr(object.__getattribute__(self, "_module"), name)


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """Experts function for transformers' registry."""
    state: ExpertsState | None = getattr(module, "_moe_offload_state", None)
    if state is None:
        return original_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    return state.run(module, hidden_states, top_k_index, top_k_weights)


def register_experts_function() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPL not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, experts_forward)


@dataclass
class ExpertsState:
    runtime: RunState
    offloaded: dict[str, torch.Tensor]  # local name -> host tensor or host stack (device-visible view for uva)
    num_experts: int
    split: dict[str, ExpertSplit] = field(default_factory=dict)  # local name -> layout, tensors split by expert
    layer: int | None = None            # N of model.layers.N, for the routing recorder
    # local name -> quant_weights.QuantLayout of tensors held quantized: their selected experts are gathered as
    # stored (values and scales, fp8 as bytes), then dequantized on the device before the eager forward
    quant: dict = field(default_factory=dict)
    # local name -> disk_tier.DiskTensor of tensors on the disk tier: their selected experts are read from the
    # checkpoint (a disk-tier split tensor's layout is in `split`, its disk experts as the "host" ids)
    disk: dict = field(default_factory=dict)
    # its index among the runtime's graph edges (graph_edge.py) when its decode steps can stream, else None
    edge: int | None = None

    def run(self, module, hidden_states, top_k_index, top_k_weights):
        # top_k_index: [T, k] expert ids; the selected experts are the only ones read.
        rt = self.runtime
        if rt.recorder is not None and self.layer is not None:
            rt.routed[self.layer] = top_k_index.detach()
        decode = rt.step_tokens == 1
        # The CPU kernels (fused.py) read quantized experts as stored: nothing is dequantized, wherever they lie.
        fused = rt.compute.fused_for(module, hidden_states, self.quant)
        quant = self.quant if fused else None
        if not self.offloaded and not self.disk and (fused or not self.quant):
            return rt.compute(module, {}, hidden_states, top_k_index, top_k_weights, decode=decode, quant=quant)
        # A decode step with a device cache reads each selected expert from its cache pages when it holds it
        # (device_cache.py), so even uva's whole host tensors are then gathered rather than read in place.
        cached = rt.cache_step and bool(self.offloaded or self.disk) and rt.cache.serves(self.layer)
        hc = rt.host_compute
        if hc is not None and self.layer is not None and hc.serves(module, self):
            # Host compute (host_compute.py): the plan asks the cost model which off-device experts the host computes.
            selected, local = Selected.of(top_k_index)
            plan = plan_step(rt, self, selected, cached, host=hc.side(rt, self, selected, hidden_states))
            if plan.host is not None:
                plan.charge(rt)
                self.end_lookahead(plan)
                return hc.run(rt, self, module, plan, hidden_states, top_k_weights, fused, self.quant)
            staged, local, count = self.gather(module, top_k_index, cached, dequantize=not fused,
                                               planned=(selected, local, plan))
            view = _StagedExperts(module, staged, count)
            return rt.compute(module, staged, hidden_states, local, top_k_weights, view=view, decode=decode,
                              quant=quant)
        if streams(self, fused, cached):    # CPU-only disk-tier decode: each expert computed as its rows land
            if torch.compiler.is_compiling() and self.edge is not None:   # one opaque node of the graph
                return rt.edges.experts(self.edge, hidden_states, top_k_index, top_k_weights)
            return streamed_step(self, module, hidden_states, top_k_index, top_k_weights)
        # With a look-ahead, a decode step gathers too: its predicted experts come from the rows copied ahead.
        ahead = rt.lookahead is not None and rt.decode_step
        if rt.reads.in_place and not self.split and not cached and (fused or not self.quant) and not self.disk \
                and not ahead:
            # In place: the kernels index each selected expert of the host view; the distinct experts are
            # counted on the device at the end of the forward call (no read back during the step).
            rt.routes.append(InPlaceRead(self.layer, top_k_index.detach()))
            return rt.compute(module, {}, hidden_states, top_k_index, top_k_weights, decode=decode, quant=quant)
        planned = None
        if not rt.decode_step and not cached:   # a prefill: staged a chunk at a time when it would not fit (chunked.py)
            selected, local = Selected.of(top_k_index)
            if too_big(self, selected):
                return chunked_step(self, module, selected, hidden_states, top_k_weights)
            planned = (selected, local, None)
        staged, local, count = self.gather(module, top_k_index, cached, dequantize=not fused, planned=planned)
        view = _StagedExperts(module, staged, count)
        return rt.compute(module, staged, hidden_states, local, top_k_weights, view=view, decode=decode, quant=quant)

    def end_lookahead(self, plan) -> None:
        rt = self.runtime
        if rt.lookahead is not None and rt.decode_step and (self.disk or self.offloaded):
            rt.lookahead.end_layer(self.layer, plan.below())     # what the guesses saved

    @torch.compiler.disable
    def gather(self, module, top_k_index, cached: bool, dequantize: bool = True, planned=None):
        """The U selected experts gathered into reused buffers, each from the tier that holds it, and the routing
        renumbered 0..U-1: (local name -> [U, ...] stack, local ids [T, k], U). Data-dependent (which experts,
        where they lie): it runs eagerly, an edge of a compiled decode step (compiled.py). `dequantize`: quantized
        tensors become the compute dtype (else they stay as stored, scales beside them, for the fused kernels).
        `planned`: (selection, renumbered routing, read plan) made already (host compute chose the device)."""
        rt = self.runtime
        # The eager loop then visits them in the same ascending order, with the same values (bit-identical
        # arithmetic); the grouped kernels index the gathered stack with the renumbered ids. The selected ids are
        # read to the host once (Selected.of): the read plan is made on that list (read_plan.py), charged once, and
        # carried out by one executor (read_executor.py).
        selected, local, plan = planned if planned is not None else (*Selected.of(top_k_index), None)
        if plan is None:
            plan = plan_step(rt, self, selected, cached)
        plan.charge(rt)
        staged = execute(rt, self, plan)
        self.end_lookahead(plan)
        self.complete(module, staged, selected.index, dequantize)
        return staged, local, len(selected.ids)

    def complete(self, module, staged: dict, index: torch.Tensor, dequantize: bool = True) -> None:
        """The gathered stacks of the selection `index` made ready to compute: quantized ones dequantized (or, kept
        as stored, the resident ones' rows and scales renumbered too), and the module's resident per-expert tensors
        renumbered onto the selection (a device-local gather, no link bytes)."""
        rt = self.runtime
        if self.quant and dequantize:   # the gathered stored bytes -> the compute dtype (quant_weights.py)
            rt.dequantizer.selected_experts(module, self.quant, staged, index)
        elif self.quant:
            rt.dequantizer.stored_experts(module, self.quant, staged, index)
        for name, p in module.named_parameters(recurse=False):
            if name not in staged and p.dim() >= 1 and p.shape[0] == self.num_experts:
                staged[name] = p.index_select(0, index)
