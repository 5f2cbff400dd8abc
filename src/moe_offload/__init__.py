"""moe-offload: run Mixture-of-Experts models whose weights do not fit on the accelerator.

    import moe_offload as mo
    plan = mo.plan("path/to/model", offload_gb=20)
    print(plan.tiers["model.layers.3.mlp.experts.down_proj"])   # "host"
"""

from __future__ import annotations

from .errors import (AuditError, BudgetError, CheckpointError, ConfigError, DeviceError, MoeOffloadError,
                     PlanMismatchError, SelectorError, TraceError)
from .model.inventory import Inventory, TensorRecord
from .run.offloader import Offloader
from .planning.placement import Plan, PlannedTensor, Policy, Tier
from .model.roles import Role
from .api import audit, load, plan, transform_weights, update_weights
from .loading.handle import Loaded

__version__ = "0.1.0"

__all__ = [
    "plan", "load", "Loaded", "audit", "Offloader", "transform_weights", "update_weights", "Plan", "PlannedTensor", "Policy", "Tier", "Role", "Inventory", "TensorRecord",
    "MoeOffloadError", "ConfigError", "CheckpointError", "BudgetError", "SelectorError", "DeviceError", "AuditError",
    "TraceError", "PlanMismatchError",
]
