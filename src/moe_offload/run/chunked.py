"""A layer step whose selected experts would not fit the staging bound, gathered and computed a chunk at a time.

The gathering path stages a step's U selected experts into reused buffers [U, ...]; a prefill of a few prompts
selects nearly every expert of a layer, and at released dimensions that is a whole layer's experts at once (Qwen3-
30B-A3B: 128 x 9.4 MB, 1.2 GB), the largest buffer of a run and more than a memory budget's reserve is meant for.
Above `STAGING_BOUND` bytes (per layer step, over the module's offloaded tensors and the buffers quantized experts
are dequantized into) such a step goes here instead:

    the selected experts, ascending, in chunks of as many as fit the bound (at least one);
    per chunk, the read plan of those experts (read_plan.plan_step: charged once per chunk, which sums to the
    step's bytes), its executor's copies into the same reused buffers, dequantization of the chunk if held
    quantized (the disk experts the host cache keeps from the whole step stored as their chunk lands: read_plan.py);
    then the chunk's (token, expert) pairs computed (grouped.pair_outputs: one matrix product per
    expert, as the eager loop) and put in their slots;
    every token's pairs summed in slot order (grouped.sum_pairs).

Decode steps (a handful of experts) never come here, nor do steps through a cache or a look-ahead (decode only).
The arithmetic per expert is the eager loop's; the per-token sum runs in slot order rather than the eager loop's
expert order, so a chunked step agrees with the unchunked one within rounding (greedy tokens equal in the tests).
"""

from __future__ import annotations

import math

import torch

from .grouped import loop_project, pair_outputs, sum_pairs
from .read_executor import execute
from .read_plan import plan_step, prefill_kept
from .state import Selected, index_tensor

STAGING_BOUND = 256 << 20   # bytes of selected experts' rows a layer step stages at once, at most (but one expert)


def stage_bytes(state) -> int:
    """One expert's staged bytes: its rows of the module's offloaded tensors (host tier and disk tier), and where
    the module holds experts quantized, its dequantized rows in the compute dtype (resident ones too: a prefill
    dequantizes every selected expert, and at released dimensions that outgrows its stored bytes fourfold)."""
    host = sum(t[0].numel() * t.element_size() for t in state.offloaded.values())
    wide = sum(math.prod(q.shape[1:]) * q.compute_dtype.itemsize for q in state.quant.values())
    return host + sum(src.row_bytes for src in state.disk.values()) + wide


def too_big(state, selected: Selected, bound: int | None = None) -> bool:
    bound = STAGING_BOUND if bound is None else bound
    return len(selected.ids) > 1 and len(selected.ids) * stage_bytes(state) > bound


def chunked_step(state, module, selected: Selected, hidden: torch.Tensor, top_k_weights: torch.Tensor,
                 bound: int | None = None) -> torch.Tensor:
    """The experts module's output [T, H] for the step, its selected experts staged `bound` bytes at a time."""
    bound = STAGING_BOUND if bound is None else bound
    rt, dev = state.runtime, hidden.device
    size = max(1, bound // max(1, stage_bytes(state)))
    ids, k = list(selected.ids), selected.k
    weights = top_k_weights.reshape(-1)
    out = torch.empty((len(selected.slots), hidden.size(-1)), dtype=hidden.dtype, device=dev)
    keeps = prefill_kept(rt, state, selected)     # of the whole step's pairs, stored chunk by chunk as read
    for start in range(0, len(ids), size):
        chunk = ids[start:start + size]
        part = Selected.of_ids(chunk, dev)
        plan = plan_step(rt, state, part, False, keeps=keeps)
        plan.charge(rt)
        staged = execute(rt, state, plan)
        state.complete(module, staged, part.index)   # dequantized, resident per-expert tensors renumbered
        mine = {e: i for i, e in enumerate(chunk)}
        pairs = [s for s, e in enumerate(selected.slots) if e in mine]
        at = index_tensor(pairs, dev)
        experts = [selected.slots[s] for s in pairs]
        local = index_tensor([mine[e] for e in experts], dev)
        x = hidden.index_select(0, index_tensor([s // k for s in pairs], dev))
        y = pair_outputs(module, lambda name, i: staged[name][i], loop_project(module, staged, mine, experts), x,
                         local, weights.index_select(0, at))
        out.index_copy_(0, at, y.to(out.dtype))
    return sum_pairs(out, hidden.size(0), k, hidden.dtype)
