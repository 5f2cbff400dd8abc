"""The selected experts of a layer computed together: one gather-GEMV per projection, not a loop of small ones.

transformers' eager experts forward visits the hit experts one by one: per expert a mask lookup, a
`torch.where`, two or three small matmuls, an `index_add_`; a decode step of a 128-expert top-8 layer is
dozens of kernels and their Python. Here the S = tokens x k (token, expert) pairs of a call are computed
at once, each projection as

    out[s, o] = sum_i  W[ids[s], o, i] * x[s, i]          (accumulated in float32, rounded to the dtype)

over the expert stack `W` as it lies (the module's resident parameter, a uva view of host memory, or the
buffer the selected experts were gathered into, with `ids` renumbered to it). Written as an index, a
product and a sum, `torch.compile` (inductor) fuses the gather into the reduction: one kernel per
projection reads exactly the selected experts' rows, in place, with no copy of them (measured on a
2-core EPYC: 8 experts of a 768-wide bf16 gate_up in 285 us, against 578 us for eight `F.linear` calls
and 3.3 ms for `torch.bmm` on gathered copies; transformers' `batched_mm` is that last one).

The arithmetic: `grouped_experts` follows the experts class's own conventions (transformers'
`use_experts_implementation`: gate/up concatenated or interleaved through the class's `_apply_gate`,
transposed storage, biases) and reduces in float32 in a fixed order that does not depend on which
stack the weights come from; so a model run with `experts="grouped"` is bit-identical to the same model
with nothing offloaded run with `experts="grouped"` (its same-arithmetic reference), not to the eager
loop, which rounds through other kernels. `experts="eager"` keeps the class's own forward: the check.

Only decode steps (one new token per sequence, up to `GROUPED_MAX_ROWS` sequences) are grouped; a prefill keeps
the eager loop, in both the model and its reference: there each expert sees many tokens and a real GEMM per
expert is the better kernel (and prompt lengths would each need their own compiled kernel).

`compute.ExpertsCompute` is the choice a runtime holds (no process-global state): eager, fused, or grouped
through its own compiled kernel (static shapes, but for the leading size of gathered stacks, which varies from call to call:
the loops that do the arithmetic are the same whatever stack the rows come from). Under a compiled decode step (compiled.py) the same Python is traced inline.
"""

from __future__ import annotations

import shutil
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUPED_MAX_ROWS = 8   # sequences of a decode step up to which it is computed grouped
RECOMPILE_LIMIT = 64   # kernels a runtime may compile (row counts x gathered-stack specialisations x dtypes)


def check_kernels(device: torch.device, what: str = "--experts grouped") -> None:
    """Inductor writes and builds C++ kernels on the cpu: raise MoeOffloadError when no C++ compiler is there."""
    from ..errors import MoeOffloadError

    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise MoeOffloadError(f"{what} on the cpu needs a C++ compiler (torch.compile's inductor builds its kernels "
                              "with one): none of g++, c++, clang++ is on PATH; install one (e.g. apt install g++) "
                              "or use --experts eager")


def original_forward(module: nn.Module) -> Callable:
    # `use_experts_implementation` wraps the class's eager forward with functools.wraps.
    fwd = type(module).forward
    return getattr(fwd, "__wrapped__", fwd)


def _gemv(w: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x[s] through expert ids[s]'s matrix of the stack w: [E, O, I] (or [E, I, O] transposed) -> [S, O]."""
    if transposed:
        return (w[ids].float() * x.float()[:, :, None]).sum(1).to(x.dtype)
    return (w[ids].float() * x.float()[:, None, :]).sum(-1).to(x.dtype)


def experts_math(module: nn.Module, tensors: dict[str, torch.Tensor], project: Callable, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Everything of an experts module's forward around its two projections, for all S = T * k pairs at once:
    `project(name, ids [S], x [S, K])` -> [S, O] in x's dtype computes `name`'s expert ids[s] on x[s] (this
    module's gather-GEMV, or the CPU kernels of fused.py). The pairs' weighted outputs are summed per token in slot
    order (`sum_pairs`): where each pair was computed does not change the sum (host compute sums them so too)."""
    def rows(name, ids):
        return (tensors[name] if name in tensors else getattr(module, name))[ids]

    k = top_k_index.size(-1)
    x = hidden_states.repeat_interleave(k, dim=0)            # [S, H]
    out = pair_outputs(module, rows, project, x, top_k_index.reshape(-1), top_k_weights.reshape(-1))
    return sum_pairs(out, hidden_states.size(0), k, hidden_states.dtype)


def pair_outputs(module: nn.Module, rows: Callable, project: Callable, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The weighted output [S, O] of each (token, expert) pair: x [S, H] through expert ids[s] (`project` as in
    experts_math; `rows(name, ids)` -> [S, ...] the rows of a per-expert tensor such as a bias), times weights[s]."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    h = project(up, ids, x)
    if module.has_bias:
        h = h + rows(up + "_bias", ids)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    out = project("down_proj", ids, h)
    if module.has_bias:
        out = out + rows("down_proj_bias", ids)
    if getattr(module, "has_post_expert_norm", False):   # transformers 5.17 has no such attribute
        out = module.post_expert_norm(out)
    return out * weights.reshape(-1, 1).to(out.dtype)


def sum_pairs(out: torch.Tensor, tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, O]: each token's k pair outputs (rows t*k .. t*k+k-1 of `out`) summed, in the model's dtype."""
    return out.view(tokens, k, -1).sum(1).to(dtype)


def loop_project(module: nn.Module, tensors, position: dict[int, int], experts: list[int]):
    """experts_math's `project` as the eager loop computes: per distinct expert, one matrix product of its pairs
    (`experts`: each pair's expert, on the host; a gathered stack holds expert e at `position[e]`)."""
    transposed = bool(getattr(module, "is_transposed", False))

    def project(name: str, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gathered = name in tensors
        stack = tensors[name] if gathered else getattr(module, name)
        groups: dict[int, list[int]] = {}
        for s, e in enumerate(experts):
            groups.setdefault(e, []).append(s)
        out = None
        for e, members in groups.items():
            w = stack[position[e] if gathered else e]
            at = torch.tensor(members, dtype=torch.long, device=x.device)
            y = x.index_select(0, at) @ w if transposed else F.linear(x.index_select(0, at), w)
            if out is None:
                out = torch.empty((x.size(0), y.size(-1)), dtype=y.dtype, device=x.device)
            out.index_copy_(0, at, y)
        return out.to(x.dtype)

    return project


def grouped_experts(module: nn.Module, tensors: dict[str, torch.Tensor], hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output for [T, H] hidden states routed to top_k_index [T, k] (ids into the stacks of
    `tensors`, which default to the module's own parameters), all S = T * k pairs at once."""
    def project(name, ids, x):
        return _gemv(tensors[name] if name in tensors else getattr(module, name), ids, x, module.is_transposed)

    return experts_math(module, tensors, project, hidden_states, top_k_index, top_k_weights)


