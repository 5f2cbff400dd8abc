"""A CPU-only decode step whose checkpoint reads overlap its compute.

On a machine without an accelerator, a disk-tier layer step that gathers reads every selected expert
(READS_IN_FLIGHT at once), then computes them all: the disk waits while the CPU computes and the CPU waits while
the disk reads. Here the step's read plan (read_plan.plan_step, charged once, as the gather's) is carried out by
the same executor with its row copies queued (read_executor.Deferred): checkpoint reads, each followed by its
host-cache admission, and host-cache pages, issued in ascending expert order on the disk tier's reader threads.
A host-cache hit whose pages are one run of the arena is not copied at all: the kernels read it there, as
llama.cpp's read its page-cache pages. The caller's thread meanwhile computes the selected experts one by one,
each as soon as its rows have landed:

    plan, charge; execute (look-ahead rows copied, hits in one run placed, everything else queued), start the queue
    per selected expert, ascending: wait for its rows; its (token, expert) pairs by the CPU kernels
        (fused.kernel_project over its rows, grouped.pair_outputs), put in their slots
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
        position = {e: i for i, e in enumerate(selected.ids)}
        slots = [position[e] for e in selected.slots]          # each (token, slot) pair's row in the stacks
        k, dev = selected.k, hidden.device
        weights = top_k_weights.reshape(-1)
        out = torch.empty((len(slots), hidden.size(-1)), dtype=hidden.dtype, device=dev)
        for p in range(len(selected.ids)):                     # ascending: the order the rows are read in
            deferred.wait([p])
            # this expert's rows: where they landed, or a host-cache hit's pages in place
            rows = {name: deferred.placed.get((p, name), stack[p]).unsqueeze(0) for name, stack in staged.items()}
            pairs = [s for s, q in enumerate(slots) if q == p]
            at = index_tensor(pairs, dev)
            x = hidden.index_select(0, index_tensor([s // k for s in pairs], dev))
            project = kernel_project(module, rows, quant or {}, rt.compute.isa)
            y = pair_outputs(module, lambda name, i: rows[name][i], project, x,
                             torch.zeros(len(pairs), dtype=torch.long, device=dev), weights.index_select(0, at))
            out.index_copy_(0, at, y.to(out.dtype))
        return sum_pairs(out, hidden.size(0), k, hidden.dtype)
    finally:
        deferred.finish()
