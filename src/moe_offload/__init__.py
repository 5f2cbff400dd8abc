"""moe-offload: run Mixture-of-Experts models whose weights do not fit on the accelerator.

    import moe_offload as mo
    plan = mo.plan("path/to/model", offload_gb=20)
    print(plan.tiers["model.layers.3.mlp.experts.down_proj"])   # "host"
"""

from __future__ import annotations

from typing import Sequence

from .errors import (AuditError, BudgetError, CheckpointError, ConfigError, DeviceError, MoeOffloadError,
                     SelectorError)
from .inventory import Inventory, TensorRecord, inventory
from .planner import Plan, PlannedTensor, Policy, Tier
from .roles import Role

__version__ = "0.1.0"


def plan(source, *, offload_gb: float | None = None, device_memory_gb: float | None = None,
         reserve_gb: float | None = None, policy: str = "sparse-first", offload_params: Sequence[str] | None = None,
         dtype: str | None = None, batch: int = 1) -> Plan:
    """Plan where every weight of a model lives.

    `source`: a model folder (its safetensors headers give real dtypes and bytes), a
    config.json path, or an nn.Module (meta or real). No tensor data is read.
    """
    from . import planner

    inv = inventory(source, dtype=dtype)
    return planner.plan(inv, offload_gb=offload_gb, device_memory_gb=device_memory_gb, reserve_gb=reserve_gb,
                        policy=policy, offload_params=offload_params, batch=batch)


__all__ = [
    "plan", "Plan", "PlannedTensor", "Policy", "Tier", "Role", "Inventory", "TensorRecord", "inventory",
    "MoeOffloadError", "ConfigError", "CheckpointError", "BudgetError", "SelectorError", "DeviceError", "AuditError",
]
