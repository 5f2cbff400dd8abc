"""Host compute: a layer step's offloaded experts computed where their bytes lie, by the CPU kernels on their stored
format, while the device computes its own; only activations cross the link.

`load(expert_compute="auto"|"host"|"device")` gives the runtime a `HostCompute` (None for `device`, and for `auto`
where the cost model could never choose the host: no link, a CPU-only machine). For an experts module the CPU
kernels can compute (fused.supports) and whose every expert weight tensor is offloaded (wholly or split), a layer
step goes:

    1. the router's ids read to the host once (state.Selected: the one read a staged step makes);
    2. the read plan (read_plan.plan_step) runs the caches' policies, then asks `side` which of the experts that lie
       wholly off the device, and that the device cache neither holds nor admits, the host computes: all of them
       (`host`), or as the cost model (planning/cost_model.py) chooses for the step (`auto`), or none; their
       host-tier rows become HOST_COMPUTE reads (nothing copied), their disk-tier rows land in host memory;
    3. the executor (read_executor.py) copies what the device side needs (cache pages, rows it streams; the
       resident stacks are read in place when the device's kernels are the CPU kernels);
    4. the host's pairs start on a worker thread (inline when the device has no pair of its own: nothing to
       overlap): the tokens' hidden states to the host, the kernels over the host stacks in place (rows mapped per
       tensor, so split and landed stacks are read where they are), each pair's weighted output back;
    5. the device computes its pairs meanwhile; both sets of pair outputs are put in their slots and summed per
       token in slot order (grouped.sum_pairs), as the resident model sums them: the tokens equal the resident
       model's under the same kernels, bit for bit (the kernels' pairs are independent of one another).

What crosses the link is charged from the plan (read_plan.StepPlan.charge): no weight bytes for an expert the host
computed, its activations (hidden states in, pair outputs out) instead, reported apart (activation_counter).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

from ..planning.cost_model import ExpertCompute, Hardware, choose, step_cost
from .fused import kernel_project, supports
from .grouped import loop_project, pair_outputs, sum_pairs
from .read_executor import execute_sides
from .read_plan import HostSide, Source, StepPlan
from .state import index_tensor


class HostCompute:
    """Where a runtime computes its offloaded experts, and the worker that computes the host's share."""

    def __init__(self, mode: ExpertCompute, hardware: Hardware | None, arena=None):
        self.mode = mode
        self.hardware = hardware     # the cost model's machine (auto); None when forced
        self.arena = arena           # storage.host.HostArena: host aliases of uva views (accelerators)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-host-experts")
        self._why: dict[int, str | None] = {}     # id(module) -> why the host cannot compute it (None: it can)
        self._small: dict[tuple[int, str], object] = {}   # resident per-expert tensors (biases), row maps: on the host
        self._flops: dict[int, int] = {}
        self.steps = {ExpertCompute.HOST: 0, ExpertCompute.DEVICE: 0}   # layer steps with candidates, by side
        self.experts_on_host = 0

    # --- which modules, which steps ----------------------------------------------------------------------------
    def serves(self, module: nn.Module, state) -> bool:
        key = id(module)
        if key not in self._why:
            self._why[key] = self._why_not(module, state)
        return self._why[key] is None

    def _why_not(self, module: nn.Module, state) -> str | None:
        why = supports(module, state.quant)
        if why is not None:
            return why
        off = {*state.offloaded, *state.disk}
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == state.num_experts and name not in off:
                return f"{name} is resident whole: no expert of this layer lies wholly on the host"
        for local, q in state.quant.items():   # values and scales must lie alike (one row map for both)
            a, b = state.split.get(local), state.split.get(q.scale_local)
            if (a is None) != (b is None) or (a is not None and a.host_ids != b.host_ids):
                return f"{local} and its scales are split differently"
        return None

    def side(self, rt, state, selected, hidden: torch.Tensor):
        """The read plan's `host` callable for this step: candidates -> their HostSide, or None (the device)."""
        def decide(candidates: list[int]) -> HostSide | None:
            if not candidates or self.mode is ExpertCompute.DEVICE:
                return None
            mine = set(candidates)
            pairs = tuple(s for s, e in enumerate(selected.slots) if e in mine)
            tokens = tuple(sorted({s // selected.k for s in pairs}))
            hidden_bytes = hidden.size(-1) * hidden.element_size()
            activations = (len(tokens) + len(pairs)) * hidden_bytes
            cost = None
            if self.mode is ExpertCompute.AUTO:
                tb = rt.token_bytes
                row = tb.layers.index(state.layer)
                weights = int(sum(int(tb.expert_host[row, e]) + int(tb.expert_disk[row, e]) for e in candidates))
                cost = step_cost(self.hardware, tokens=len(tokens), pairs=len(pairs), weight_bytes=weights,
                                 flops=len(pairs) * self.flops_per_pair(state), hidden_bytes=hidden_bytes)
            where = choose(self.mode, cost)
            self.steps[where] += 1
            if where is not ExpertCompute.HOST:
                return None
            self.experts_on_host += len(candidates)
            return HostSide(tuple(candidates), pairs, tokens, activations)
        return decide

    def flops_per_pair(self, state) -> int:
        """2 x the multiply-adds of one (token, expert) pair: every expert weight matrix of the module, once."""
        key = id(state)
        if key not in self._flops:
            scales = {q.scale_local for q in state.quant.values()}
            shapes = {n: tuple(t.shape) for n, t in state.offloaded.items()}
            shapes.update({n: tuple(src.shape) for n, src in state.disk.items()})
            shapes.update({n: tuple(q.shape) for n, q in state.quant.items()})   # what it dequantizes to
            self._flops[key] = 2 * sum(int(torch.Size(s[1:]).numel()) for n, s in shapes.items()
                                       if len(s) == 3 and n not in scales)
        return self._flops[key]

    # --- one step ----------------------------------------------------------------------------------------------
    def run(self, rt, state, module: nn.Module, plan: StepPlan, hidden: torch.Tensor, top_k_weights: torch.Tensor,
            in_place: bool, quant) -> torch.Tensor:
        """The step's output [T, H]: the host's pairs on the worker, the device's meanwhile, summed in slot order.
        `in_place`: the device's kernels are the CPU kernels (resident stacks read in place, no gather)."""
        side, selected = plan.host, plan.selected
        mine = set(side.experts)
        skip = {t.name for t in plan.tensors if in_place
                and all(r.source is Source.RESIDENT for r in t.reads if r.expert not in mine)}
        staged, landed = execute_sides(rt, state, plan, skip_resident=skip)
        weights = top_k_weights.reshape(-1)
        device_pairs = [s for s in range(len(selected.slots)) if s not in set(side.pairs)]
        # to the host: the tokens' hidden states, the pairs' expert ids and routing weights
        x = hidden.index_select(0, index_tensor(list(side.tokens), hidden.device)).to("cpu")
        where = {t: i for i, t in enumerate(side.tokens)}
        local = torch.tensor([where[s // selected.k] for s in side.pairs], dtype=torch.long)
        ids = torch.tensor([selected.slots[s] for s in side.pairs], dtype=torch.long)
        w = weights.index_select(0, index_tensor(list(side.pairs), weights.device)).to("cpu")
        args = (module, state, plan, landed, x, local, ids, w, quant, rt.compute.isa)
        job = self._pool.submit(self._host_pairs, *args) if device_pairs else None
        out = torch.empty((len(selected.slots), hidden.size(-1)), dtype=hidden.dtype, device=hidden.device)
        if device_pairs:
            at = index_tensor(device_pairs, hidden.device)
            mine_out = self._device_pairs(rt, state, module, plan, staged, skip, hidden, device_pairs, weights,
                                          in_place, quant)
            out.index_copy_(0, at, mine_out)
        host_out = job.result() if job is not None else self._host_pairs(*args)
        out.index_copy_(0, index_tensor(list(side.pairs), hidden.device), host_out.to(hidden.device))
        return sum_pairs(out, hidden.size(0), selected.k, hidden.dtype)

    def _host_pairs(self, module, state, plan: StepPlan, landed, x, local, ids, w, quant, isa) -> torch.Tensor:
        """[P, H] on the cpu: the host's pairs by the kernels over the host stacks in place."""
        mine = set(plan.on_host)
        tensors, rows = {}, {}
        for t in plan.tensors:
            if t.on_disk:
                tensors[t.name] = landed[t.name]
                rows[t.name] = _row_map(state.num_experts, [(r.expert, r.position) for r in t.reads if r.expert in mine])
                continue
            host = state.offloaded[t.name]
            tensors[t.name] = self.arena.host_alias(host) if self.arena is not None else host
            split = state.split.get(t.name)
            if split is not None:       # its host stack holds host_ids in order (a whole one: row = expert id)
                key = (id(split), "host rows")
                if key not in self._small:
                    self._small[key] = _row_map(state.num_experts, [(e, r) for r, e in enumerate(split.host_ids)])
                rows[t.name] = self._small[key]
        for local_name, q in quant.items():
            rows.setdefault(q.scale_local, rows.get(local_name))
        project = kernel_project(module, tensors, quant, isa, rows)
        return pair_outputs(module, self._rows(module, tensors, rows, "cpu"), project, x[local], ids, w)

    def _device_pairs(self, rt, state, module, plan: StepPlan, staged, skip, hidden, pairs: list[int], weights,
                      in_place: bool, quant) -> torch.Tensor:
        """[P, H] on the device: the device's pairs, over the resident stacks in place (CPU kernels) or the gathered
        stacks (any other compute: one matrix product per distinct expert, as the eager loop)."""
        selected, dev = plan.selected, hidden.device
        x = hidden.index_select(0, index_tensor([s // selected.k for s in pairs], dev))
        ids = index_tensor([selected.slots[s] for s in pairs], dev)
        w = weights.index_select(0, index_tensor(pairs, dev))
        position = {e: i for i, e in enumerate(selected.ids)}
        tensors, rows = {}, {}
        for t in plan.tensors:
            if t.name in skip:
                split = state.split[t.name]
                key = (id(split), f"resident rows {dev}")
                if key not in self._small:
                    self._small[key] = _row_map(state.num_experts, [(e, r) for r, e in enumerate(split.resident_ids)],
                                                dev)
                tensors[t.name], rows[t.name] = split.resident, self._small[key]
            else:
                tensors[t.name] = staged[t.name]
                rows[t.name] = _row_map(state.num_experts, list(position.items()), dev)
        if in_place:
            for local_name, q in quant.items():
                rows.setdefault(q.scale_local, rows.get(local_name))
            project = kernel_project(module, tensors, quant, rt.compute.isa, rows)
        else:
            if quant:      # the gathered stored bytes -> the compute dtype (quant_weights.py)
                rt.dequantizer.selected_experts(module, quant, staged, selected.index)
            project = loop_project(module, tensors, position, [selected.slots[s] for s in pairs])
        return pair_outputs(module, self._rows(module, tensors, rows, dev), project, x, ids, w)

    def _rows(self, module: nn.Module, tensors, rows, device):
        """pair_outputs' `rows`: a per-expert tensor's rows for expert ids (biases), from a stack or the module."""
        def get(name: str, ids: torch.Tensor) -> torch.Tensor:
            if name in tensors:
                table = rows.get(name)
                return tensors[name][ids if table is None else table[ids]]
            key = (id(module), name)
            if key not in self._small:
                self._small[key] = {}
            table = self._small[key].get(str(device))
            if table is None:
                table = self._small[key][str(device)] = getattr(module, name).detach().to(device)
            return table[ids]
        return get

    @property
    def mechanism(self) -> str:
        if self.mode is ExpertCompute.HOST:
            return "expert compute: host (offloaded experts computed by the CPU kernels where they lie)"
        hw = self.hardware
        return (f"expert compute: auto (per layer step, the cost model: host {hw.host_bytes_per_s / 1e9:.1f} GB/s, "
                f"{hw.host_flops_per_s / 1e9:.0f} GFLOP/s; link {hw.link_bytes_per_s / 1e9:.1f} GB/s)")

    def stats(self) -> dict:
        return {"expert_compute": self.mode.value, "host_compute_steps": self.steps[ExpertCompute.HOST],
                "device_compute_steps": self.steps[ExpertCompute.DEVICE], "experts_on_host": self.experts_on_host}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._small.clear()


def _row_map(experts: int, pairs: list[tuple[int, int]], device="cpu") -> torch.Tensor:
    """int64 [E]: expert -> its row in a stack (-1 where the stack does not hold it)."""
    rows = [-1] * experts
    for e, r in pairs:
        rows[e] = r
    return torch.tensor(rows, dtype=torch.long, device=device)


def compute_options(mode, link_gbps=None, host_gbps=None, host_gflops=None) -> ExpertCompute:
    """load's expert_compute and rates, checked (MoeOffloadError naming the choices or the bad rate)."""
    from ..errors import MoeOffloadError

    try:
        mode = ExpertCompute(mode or ExpertCompute.AUTO.value)
    except ValueError:
        raise MoeOffloadError(f"expert_compute={mode!r}: use {' or '.join(m.value for m in ExpertCompute)}") from None
    for flag, v in (("link_gbps", link_gbps), ("host_gbps", host_gbps), ("host_gflops", host_gflops)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf")):
            raise MoeOffloadError(f"{flag}={v!r} is not a rate: give a positive number (GB/s: 1e9 bytes a second; "
                                  "GFLOP/s)")
    return mode


def host_compute_for(mode, device: torch.device, arena, *, offloads_experts: bool, link_gbps=None, host_gbps=None,
                     host_gflops=None, measure_again: bool = False, progress=None) -> HostCompute | None:
    """The runtime's HostCompute for load's `expert_compute` (auto, host, device) and rates, or None: `device`, a
    plan that offloads no routed expert, or `auto` on a CPU-only machine (the device reads host memory in place: host
    compute could only add a hand-off), or without a link it knows. `auto` measures what is not given: the link on an accelerator, the host's rates once per machine
    (kernels/host_rates.py, cached)."""
    from ..kernels import kernels
    from ..kernels.host_rates import link_bytes_per_s, measure

    mode = compute_options(mode, link_gbps, host_gbps, host_gflops)
    if mode is ExpertCompute.DEVICE or not offloads_experts:
        return None
    if mode is ExpertCompute.AUTO and device.type == "cpu":
        return None                 # the device is the host: nothing to choose
    link = link_gbps * 1e9 if link_gbps is not None else link_bytes_per_s(device, progress)
    if mode is ExpertCompute.AUTO and link is None:
        return None
    kernels(progress=progress)      # the host's kernels: KernelUnavailable (an `error:`) when they cannot build
    if mode is ExpertCompute.HOST:
        return HostCompute(mode, None, arena)
    rates = measure(again=measure_again, progress=progress) if host_gbps is None or host_gflops is None else None
    hardware = Hardware(host_gbps * 1e9 if host_gbps is not None else rates.bytes_per_s,
                        host_gflops * 1e9 if host_gflops is not None else rates.flops_per_s, link)
    return HostCompute(mode, hardware, arena)


def host_compute_stats(hc: HostCompute | None) -> dict:
    if hc is None:
        return {"expert_compute": ExpertCompute.DEVICE.value, "host_compute_steps": 0, "device_compute_steps": 0,
                "experts_on_host": 0}
    return hc.stats()
