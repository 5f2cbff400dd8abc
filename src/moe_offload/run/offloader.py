"""`Offloader.wrap_modules`: offload each module as a generator builds it.

Engines build decoder layers from a generator (vLLM's `make_layers`). Consuming the
generator first and offloading afterwards puts every layer on the device at once and runs
out of memory on exactly the models that need offloading (the first fix attempt did this).
Here module i is offloaded before module i+1 is built, so device memory during
construction stays within the resident bytes plus one module.

With a global `Plan`, each tensor goes straight to its planned tier. Without one (budget
only) there are two phases: routed experts and lookup tables (density < 1) are offloaded
as each module is yielded, across every call; dense tensors only in `finalize()`, in
declaration order, and only if budget remains. So a vision tower wrapped before the
language model never takes budget its experts need.

Names: the i-th module a call's generator yields names its tensors `f"{prefix}.{i}.{name}"`
(or `f"{i}.{name}"` with no prefix), `name` as its own `named_parameters()` gives it.
Reading: offloaded weights are read in place (host memory on CPU, uva views on CUDA).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from ..errors import BudgetError, MoeOffloadError, SelectorError
from ..model.inventory import component_of, layer_of, TensorRecord
from ..planning.planner import matches_selector
from ..planning.placement import GiB, Plan, Policy, Tier
from ..model.roles import Role, classify
from ..storage.host import HostArena, resolve_device

_SPARSE = (Role.EMBEDDING, Role.ROUTED_EXPERT)


class Offloader:
    def __init__(self, *, offload_gb: float | None = None, policy: str = "sparse-first",
                 offload_params: Sequence[str] | None = None, plan: Plan | None = None, device=None,
                 backend: str | None = None):
        if plan is not None and (offload_gb is not None or offload_params):
            raise MoeOffloadError("give the Offloader either a plan or budget options, not both")
        if plan is None and offload_gb is None:
            raise BudgetError("the Offloader has neither a plan nor offload_gb, so it would offload nothing: give "
                              "offload_gb=X (GiB) or plan=moe_offload.plan(...)")
        # Experts by id: all of a tensor's experts on the host is the whole tensor; any other subset is a split.
        split = [t.name for t in plan.tensors if t.is_split] if plan is not None else []
        if split:
            raise MoeOffloadError(f"the plan offloads {split[0]} in part (expert slices); wrap_modules places "
                                  "whole tensors: use moe_offload.load for such a plan, or plan without slicing")
        on_disk = [t.name for t in plan.tensors if t.tier == Tier.DISK] if plan is not None else []
        if on_disk:
            raise MoeOffloadError(f"the plan puts {len(on_disk)} tensor(s) on disk (first: {on_disk[:2]}); the "
                                  "disk tier is not implemented yet: plan with host and device tiers only")
        if offload_gb is not None and (not math.isfinite(offload_gb) or offload_gb < 0):
            raise BudgetError(f"offload_gb {offload_gb} is not a size: give a non-negative number of GiB")
        if policy not in (Policy.SPARSE_FIRST.value, Policy.DECLARATION.value):
            raise SelectorError(f"unknown policy {policy!r}: use sparse-first or declaration")
        if backend not in (None, "uva"):
            raise MoeOffloadError(f"wrap_modules reads offloaded weights in place (uva); backend {backend!r} "
                                  "is available through moe_offload.load")
        self.device = resolve_device(device)
        self.plan_tiers = plan.tiers if plan is not None else None
        self.budget = math.ceil((offload_gb or 0) * GiB)
        self.policy = policy
        # A string is one selector (as in mo.plan), not a sequence of one-letter selectors.
        self.selectors = (offload_params,) if isinstance(offload_params, str) else tuple(offload_params or ())
        self.arena = HostArena(self.device, want_uva=True)
        self._tiers: dict[str, str] = {}
        self._pending_dense: list[tuple[nn.Module, str, str, int]] = []  # (module, local name, full name, bytes)
        self._matched: set[str] = set()
        self.offloaded_bytes = 0

    # --- public -------------------------------------------------------------------------
    def wrap_modules(self, generator: Iterable[nn.Module], prefix: str = "") -> list[nn.Module]:
        """Offload each module as it is yielded (before the next is built); returns them in order."""
        modules = []
        for i, module in enumerate(generator):
            base = f"{prefix}.{i}" if prefix else f"{i}"
            self._place(module, base)
            modules.append(module)
        return modules

    def finalize(self) -> None:
        """After the last wrap_modules: budget-only mode spills dense tensors, declaration order, if budget remains."""
        if self.selectors:
            missing = [s for s in self.selectors if s not in self._matched]
            if missing:
                raise SelectorError(f"offload_params {missing} matched no tensor of the wrapped modules "
                                    "(selectors match whole dot-separated segments)")
        if self.plan_tiers is not None:
            return
        by_module: dict[int, list] = {}
        for module, local, full, nbytes in self._pending_dense:
            if self.offloaded_bytes >= self.budget:
                break
            by_module.setdefault(id(module), [module, []])[1].append((local, full))
            self.offloaded_bytes += nbytes
        for module, items in by_module.values():
            self._move(module, items, region=f"dense:{items[0][1]}")
        self._pending_dense.clear()

    def tiers(self) -> dict[str, str]:
        return dict(self._tiers)

    @property
    def mechanism(self) -> str:
        return self.arena.mechanism

    # --- placement ----------------------------------------------------------------------
    def _place(self, module: nn.Module, base: str) -> None:
        entries = []
        for local, p in module.named_parameters():
            full = f"{base}.{local}"
            owner = module.get_submodule(local.rpartition(".")[0]) if "." in local else module
            rec = TensorRecord(full, tuple(p.shape), str(p.dtype).removeprefix("torch."),
                               p.numel() * p.element_size(), layer_of(full), component_of(full),
                               type(owner).__name__)
            entries.append((local, full, rec))
            self._tiers[full] = Tier.DEVICE.value
        if self.plan_tiers is not None:
            unknown = [full for _, full, _ in entries if full not in self.plan_tiers]
            if unknown:
                raise MoeOffloadError(f"the plan has no tier for {unknown[:3]}: it was made for other module "
                                      "names; plan with the same prefix and module order")
            move = [(local, full) for local, full, _ in entries if self.plan_tiers[full] != Tier.DEVICE]
            self.offloaded_bytes += sum(rec.bytes for local, full, rec in entries if (local, full) in move)
            self._move(module, move, region=base)
            return
        eligible = [(local, full, rec) for local, full, rec in entries
                    if not self.selectors or self._selected(full)]
        if self.selectors or self.policy == Policy.DECLARATION.value:
            now = eligible                       # declaration order, as yielded
        else:
            now = sorted((e for e in eligible if classify(e[2]) in _SPARSE),
                         key=lambda e: 0 if classify(e[2]) == Role.EMBEDDING else 1)
            self._pending_dense += [(module, local, full, rec.bytes) for local, full, rec in eligible
                                    if classify(rec) not in _SPARSE]
        move = []
        for local, full, rec in now:
            if self.offloaded_bytes >= self.budget:
                break
            move.append((local, full))
            self.offloaded_bytes += rec.bytes
        self._move(module, move, region=base)

    def _selected(self, full: str) -> bool:
        hit = [s for s in self.selectors if matches_selector(full, s)]
        self._matched.update(hit)
        return bool(hit)

    def _move(self, module: nn.Module, items: list[tuple[str, str]], region: str) -> None:
        """Copy these parameters into one exact-size host slab and free their device copies."""
        if not items:
            return
        params = [(local, full, module.get_parameter(local)) for local, full in items]
        placed = self.arena.allocate(region, [(full, tuple(p.shape), p.dtype) for _, full, p in params])
        for local, full, p in params:
            host, visible = placed[full]
            with torch.no_grad():
                host.copy_(p.detach())
            owner_name, _, leaf = local.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._parameters[leaf] = nn.Parameter(visible, requires_grad=p.requires_grad)
            self._tiers[full] = Tier.HOST.value
