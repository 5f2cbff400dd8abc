"""A CPU-only decode step whose checkpoint reads overlap its compute.

On a machine without an accelerator, a disk-tier layer step that gathers reads every selected expert
(READS_IN_FLIGHT at once), then computes them all: the disk waits while the CPU computes and the CPU waits while
the disk reads. Here the step's read plan (read_plan.plan_step, charged once, as the gather's) is carried out by
the same executor with its row copies queued (read_executor.Deferred): checkpoint reads, each followed by its
host-cache admission, and host-cache pages, issued in ascending expert order on the disk tier's reader threads.
A host-cache hit whose pages are one run of the arena is not copied at all: the kernels read it there, as
llama.cpp's read its page-cache pages; nor is a resident expert (a split tensor's resident row, a whole resident
tensor's): the kernels read the module's own memory, as the resident fused step does. A miss the host cache
admits into one run of pages is read straight into them. The caller's thread meanwhile computes the experts whose
rows are all in place at once, then each of the others as soon as its rows have landed:

    plan, charge; execute (look-ahead rows copied, hits in one run and resident rows placed, the rest queued), start
    the experts with nothing queued: their (token, expert) pairs by the CPU kernels, one call per projection over
        every stack the rows lie in (the module's parameter, a split tensor's resident stack, the host cache's
        arena seen as a stack of rows starting at every page, the gathered buffer), grouped.pair_outputs (nothing
        queued at all, as in most steps a warm host cache serves: every pair at once, none picked out or scattered)
    each other expert, in the order its rows are read: wait for them; its pairs likewise, with those of the experts
        whose rows have landed meanwhile
    every token's pairs summed in slot order (grouped.sum_pairs)

The kernels compute each pair on its own (a row's dot products do not depend on the call's other pairs) and the
pairs are summed in slot order as the gathering fused step sums them, so a streamed step equals that step bit for
bit (tests/run/test_streamed.py). Taken by decode steps computed by the CPU kernels on a cpu device whose experts
module has disk-tier tensors (and no device cache in the step); every other step gathers (experts.py).
"""

from __future__ import annotations

import torch

from ..kernels import expert_gemv
from .fused import kernel_project
from .grouped import pair_outputs, sum_pairs
from .read_executor import Deferred, execute_sides
from .read_plan import plan_step
from .state import Selected, index_tensor


def streams(state, fused: bool, cached: bool) -> bool:
    """Whether this layer step is streamed: a decode step of the CPU kernels over disk-tier tensors, on a cpu
    device, not through a device cache."""
    rt = state.runtime
    return bool(state.disk) and fused and not cached and rt.decode_step and rt.device.type == "cpu" \
        and rt.disk is not None


@torch.compiler.disable
def streamed_step(state, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output [T, H], its selected experts computed as their rows land. Data-dependent
    (which experts, where their rows lie, reader threads): it runs eagerly, an edge of a compiled decode step
    (compiled.py), as the gather does."""
    rt = state.runtime
    selected = Selected.picked(top_k_index)
    plan = plan_step(rt, state, selected, False)
    plan.charge(rt)
    deferred = Deferred()
    try:
        staged, _ = execute_sides(rt, state, plan, deferred=deferred)
        deferred.start(rt.disk.submit)
        state.end_lookahead(plan)
        sources = _sources(module, state, selected.ids, staged, deferred)
        position = {e: i for i, e in enumerate(selected.ids)}
        slots = [position[e] for e in selected.slots]          # each (token, slot) pair's position in the selection
        k, dev = selected.k, hidden.device
        weights = top_k_weights.reshape(-1)
        project = _project(module, sources, state.quant, rt.compute.isa)

        def rows(name, ids):     # a per-expert tensor's rows (a bias) of these positions
            return torch.stack([stack[row] for stack, row in (sources[name][p] for p in ids.tolist())])

        def compute(positions: set[int]) -> None:     # these positions' pairs, into `out`
            pairs = [s for s, q in enumerate(slots) if q in positions]
            at = index_tensor(pairs, dev)
            x = hidden.index_select(0, index_tensor([s // k for s in pairs], dev))
            y = pair_outputs(module, rows, project, x, torch.tensor([slots[s] for s in pairs]),
                             weights.index_select(0, at))
            out.index_copy_(0, at, y.to(out.dtype))

        later = sorted(deferred.pending)
        if not later:            # every row in place: every pair in one go, none picked out or scattered
            x = hidden.repeat_interleave(k, dim=0)         # [S, H], as grouped.experts_math
            y = pair_outputs(module, rows, project, x, torch.tensor(slots), weights)
            return sum_pairs(y.to(hidden.dtype), hidden.size(0), k, hidden.dtype)
        out = torch.empty((len(slots), hidden.size(-1)), dtype=hidden.dtype, device=dev)
        ready = set(range(len(selected.ids))) - set(later)
        if ready:
            compute(ready)
        while later:                                           # the order their rows are read in
            landed = [later[0], *deferred.landed(later[1:])]   # the next, and those already in with it: one call
            deferred.wait(landed)
            compute(set(landed))
            later = [p for p in later if p not in landed]
        return sum_pairs(out, hidden.size(0), k, hidden.dtype)
    finally:
        deferred.finish()


def _sources(module, state, ids: list[int], staged: dict, deferred: Deferred) -> dict[str, list]:
    """Per-expert tensor -> per position of the selection, (stack, row): where the kernels read that expert."""
    sources = {name: [deferred.placed.get((i, name), (stack, i)) for i in range(len(ids))]
               for name, stack in staged.items()}
    scales = {q.scale_local for q in state.quant.values()}
    own = [*module.named_parameters(recurse=False), *((n, b) for n, b in module.named_buffers(recurse=False)
                                                      if n in scales)]
    for name, p in own:     # resident whole: the module's own parameter (or a quantized one's scales)
        if name not in sources and p.dim() >= 1 and p.shape[0] == state.num_experts:
            sources[name] = [(p, e) for e in ids]
    return sources


def _project(module, sources: dict[str, list], quant: dict, isa):
    """grouped.pair_outputs's `project` over `sources`: ids are positions of the selection. A float projection is
    one kernel call over every stack its rows lie in (each pair names its stack; each pair is computed on its own,
    so where its rows lie changes no bit). A quantized projection reads its values and its scales: one call
    (fused.kernel_project's) per pair of stacks where each expert's rows have the same index in both and the scales
    are one contiguous stack (the kernel reads scales so), else one per expert on its own one-row stacks."""
    transposed = bool(getattr(module, "is_transposed", False))

    def project(name: str, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = quant.get(name)
        if q is None:
            return _float_project(sources[name], ids, x, transposed, isa)
        names = (name, q.scale_local)
        groups: dict[tuple, tuple[dict, list[int], list[int]]] = {}
        for i, p in enumerate(ids.tolist()):
            where = [sources[n][p] for n in names]
            rows = {r for _, r in where}
            if len(rows) == 1 and all(s.is_contiguous() for s, _ in where[1:]):
                key, stacks, row = tuple(id(s) for s, _ in where), {n: s for n, (s, _) in zip(names, where)}, \
                    rows.pop()
            else:                                     # this expert alone, its rows as one-row stacks
                key, stacks, row = ("alone", i), {n: s[r:r + 1] for n, (s, r) in zip(names, where)}, 0
            g = groups.setdefault(key, (stacks, [], []))
            g[1].append(i)
            g[2].append(row)

        def on(stacks, rows, xs):
            return kernel_project(module, stacks, {name: q}, isa)(name, torch.tensor(rows), xs)

        if len(groups) == 1:
            stacks, _, rows = next(iter(groups.values()))
            return on(stacks, rows, x)
        out = None
        for stacks, members, rows in groups.values():
            at = torch.tensor(members)
            y = on(stacks, rows, x.index_select(0, at))
            if out is None:
                out = torch.empty((x.size(0), y.size(-1)), dtype=y.dtype)
            out.index_copy_(0, at, y)
        return out

    return project


def _float_project(where: list, ids: torch.Tensor, x: torch.Tensor, transposed: bool, isa) -> torch.Tensor:
    """x [S, K] through the expert at position ids[s] of `where` ((stack, row) per position): one kernel call over
    the stacks those rows lie in, in x's dtype."""
    stacks, index, rows, which = [], {}, [], []
    for stack, row in (where[p] for p in ids.tolist()):
        i = index.setdefault(id(stack), len(stacks))
        if i == len(stacks):
            stacks.append(stack)
        rows.append(row)
        which.append(i)
    if len(stacks) == 1:
        y = expert_gemv(x, stacks[0], torch.tensor(rows), transposed=transposed, isa=isa)
    else:
        y = expert_gemv(x, tuple(stacks), torch.tensor(rows), which=torch.tensor(which), transposed=transposed, isa=isa)
    return y.to(x.dtype)
