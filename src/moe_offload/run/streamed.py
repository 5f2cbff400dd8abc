"""A CPU-only decode step whose checkpoint reads overlap its compute.

On a machine without an accelerator, a disk-tier layer step that gathers reads every selected expert
(READS_IN_FLIGHT at once), then computes them all: the disk waits while the CPU computes and the CPU waits while
the disk reads. Here the step's read plan (read_plan.plan_step, charged once, as the gather's) is carried out by
the same executor with its row copies queued (read_executor.Deferred): checkpoint reads, each followed by its
host-cache admission, and host-cache pages, issued in ascending expert order on the disk tier's reader threads.
The caller's thread meanwhile computes the selected experts `STREAM_CHUNK` at a time, each chunk as soon as its
rows have landed:

    plan, charge; execute (look-ahead rows copied, everything else queued), then start the queue
    per chunk of selected experts, ascending: wait for its rows; its (token, expert) pairs by the CPU kernels
        (fused.kernel_project over the gathered stacks, grouped.pair_outputs), put in their slots
    every token's pairs summed in slot order (grouped.sum_pairs)

The kernels compute each pair on its own (a row's dot products do not depend on the call's other pairs) and the
pairs are summed in slot order as the gathering fused step sums them, so a streamed step equals that step bit for
bit (tests/run/test_streamed.py). Taken by decode steps computed by the CPU kernels on a cpu device whose experts
module has disk-tier tensors (and no device cache in the step); every other step gathers (experts.py).
"""

from __future__ import annotations

import torch

from .fused import kernel_project
from .grouped import pair_outputs, sum_pairs
from .read_executor import Deferred, execute_sides
from .read_plan import plan_step
from .state import Selected, index_tensor

# Selected experts computed per wait. One expert's kernels (a few ms at released widths) are as long as a read of
# the next: small chunks start the compute early; two keeps the per-call overhead below a percent.
STREAM_CHUNK = 2


def streams(state, fused: bool, cached: bool) -> bool:
    """Whether this layer step is streamed: a decode step of the CPU kernels over disk-tier tensors, on a cpu device,
    not through a device cache."""
    rt = state.runtime
    return bool(state.disk) and fused and not cached and rt.decode_step and rt.device.type == "cpu" \
        and rt.disk is not None


def streamed_step(state, module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  quant) -> torch.Tensor:
    """The experts module's output [T, H], its selected experts computed as their rows land."""
    rt = state.runtime
    selected, _ = Selected.of(top_k_index)
    plan = plan_step(rt, state, selected, False)
    plan.charge(rt)
    deferred = Deferred()
    try:
        staged, _ = execute_sides(rt, state, plan, deferred=deferred)
        deferred.start(rt.disk.submit)
        state.end_lookahead(plan)
        state.complete(module, staged, selected.index, dequantize=False)   # resident per-expert tensors renumbered
        project = kernel_project(module, staged, quant or {}, rt.compute.isa)
        position = {e: i for i, e in enumerate(selected.ids)}
        slots = [position[e] for e in selected.slots]          # each (token, slot) pair's row in the stacks
        k, dev = selected.k, hidden.device
        weights = top_k_weights.reshape(-1)
        out = torch.empty((len(slots), hidden.size(-1)), dtype=hidden.dtype, device=dev)
        for start in range(0, len(selected.ids), STREAM_CHUNK):
            chunk = range(start, min(start + STREAM_CHUNK, len(selected.ids)))
            deferred.wait(chunk)
            pairs = [s for s, p in enumerate(slots) if p in chunk]
            at = index_tensor(pairs, dev)
            x = hidden.index_select(0, index_tensor([s // k for s in pairs], dev))
            y = pair_outputs(module, lambda name, i: staged[name][i], project, x,
                             index_tensor([slots[s] for s in pairs], dev), weights.index_select(0, at))
            out.index_copy_(0, at, y.to(out.dtype))
        return sum_pairs(out, hidden.size(0), k, hidden.dtype)
    finally:
        deferred.finish()
