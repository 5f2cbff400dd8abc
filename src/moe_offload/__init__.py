"""moe-offload: run Mixture-of-Experts models whose weights do not fit on the accelerator.

    import moe_offload as mo
    plan = mo.plan("path/to/model", offload_gb=20)
    print(plan.tiers["model.layers.3.mlp.experts.down_proj"])   # "host"
"""

from __future__ import annotations

from typing import Sequence

from .errors import (AuditError, BudgetError, CheckpointError, ConfigError, DeviceError, MoeOffloadError,
                     PlanMismatchError, SelectorError, TraceError)
from .inventory import Inventory, TensorRecord
from .offloader import Offloader
from .planner import Plan, PlannedTensor, Policy, Tier
from .roles import Role

__version__ = "0.1.0"


def load(model_dir, *, device=None, backend: str | None = None, plan: "Plan | str | None" = None,
         dtype: str | None = None, progress: bool = False, cache_gb: float | None = None,
         cache_policy: str | None = None, **budget):
    """Build a model from a local checkpoint straight into its plan; returns (model, plan).

    Budget options as for `plan` (offload_gb, device_memory_gb, reserve_gb, host_memory_gb,
    cpu_only, policy, offload_params, batch), or `plan=` a Plan / saved plan JSON. The model is an ordinary
    transformers model (`model.generate(...)` works) with a `moe_offload_runtime` attribute
    that says which mechanism is used and counts the bytes read over the link.
    `cache_gb` (with `cache_policy`): a device-side cache of that many GiB for the offloaded routed
    experts that decode steps fetch (`model.moe_offload_runtime.cache.stats()`: hits and misses).
    """
    from .loader import load as _load

    return _load(model_dir, device=device, backend=backend, plan=plan, dtype=dtype, progress=progress,
                 cache_gb=cache_gb, cache_policy=cache_policy, **budget)


def transform_weights(model, fn, *, names=None):
    """Apply fn(name, tensor) -> tensor to weights of a loaded model, keeping every tensor in its tier."""
    from .transforms import transform_weights as _transform

    return _transform(model, fn, names=names)


def update_weights(model, weights):
    """Write new values (e.g. an RL weight update) into a loaded model's weights in place, keeping tiers."""
    from .transforms import update_weights as _update

    return _update(model, weights)


def audit(model, plan: Plan):
    """Every tensor whose actual tier differs from the plan: [(name, planned, actual, bytes)]; empty when in place."""
    from .auditor import audit as _audit

    return _audit(model, plan)


def plan(source, *, offload_gb: float | None = None, device_memory_gb: float | None = None,
         reserve_gb: float | None = None, policy: str = "sparse-first",
         offload_params: str | Sequence[str] | None = None, dtype: str | None = None, batch: int = 1,
         stats=None, host_memory_gb: float | None = None, cpu_only: bool = False) -> Plan:
    """Plan where every weight of a model lives.

    `source`: a model folder (its safetensors headers give real dtypes and bytes), a
    config.json path, or an nn.Module (meta or real). No tensor data is read.
    `offload_params`: one selector (a string) or several.
    `stats` (with policy="frequency"): layer -> decode-token picks per expert, e.g.
    `moe_offload.traces.expert_counts(moe_offload.traces.read_trace(path))`.
    `host_memory_gb`: the host tier's GiB; what leaves the device beyond it is planned on `disk`.
    `cpu_only`: plan for a machine whose device is host memory: `device_memory_gb` alone then bounds
    the RAM the weights hold and the rest is on disk (the CLI sets it from the device it resolves).
    """
    from . import planner
    from .inventory import inventory

    inv = inventory(source, dtype=dtype)
    return planner.plan(inv, offload_gb=offload_gb, device_memory_gb=device_memory_gb, reserve_gb=reserve_gb,
                        policy=policy, offload_params=offload_params, batch=batch, stats=stats,
                        host_memory_gb=host_memory_gb, cpu_only=cpu_only)


__all__ = [
    "plan", "load", "audit", "Offloader", "transform_weights", "update_weights", "Plan", "PlannedTensor", "Policy", "Tier", "Role", "Inventory", "TensorRecord",
    "MoeOffloadError", "ConfigError", "CheckpointError", "BudgetError", "SelectorError", "DeviceError", "AuditError",
    "TraceError", "PlanMismatchError",
]
