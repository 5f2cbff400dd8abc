"""Access density: the expected fraction of a tensor's bytes that one decoded step reads (docs/design.md),
and the expert axis a fused routed-expert tensor may be offloaded along, expert by expert.

    untied input embedding / lookup table     rows read / rows          min(b, rows) / rows
    routed expert tensor (E experts, top-k)   1 - (1 - k/E)^b           (b = sequences decoded together)
    everything else (dense)                   1

The planner, the frequency policy and a saved plan's tensors (PlannedTensor.density) all rank and
count by these functions; a saved plan has no module classes, so `expert_axis` also judges a
tensor from the plan's own fields alone.
"""

from __future__ import annotations

from typing import Sequence

from ..model.inventory import Inventory, TensorRecord
from ..model.roles import Role


def access_density(role: str, shape: Sequence[int], experts: int | None, top_k: int | None, batch: int = 1) -> float:
    """Expected fraction of a tensor's bytes read by one decode step of `batch` sequences."""
    if role == Role.ROUTED_EXPERT and experts and top_k:
        return 1.0 - (1.0 - top_k / experts) ** batch
    if role == Role.EMBEDDING and shape:
        return min(batch, shape[0]) / shape[0]
    return 1.0


def record_density(record: TensorRecord, role: Role, inv: Inventory, batch: int = 1) -> float:
    """access_density of one inventory record: routed experts at the model's E and top-k."""
    return access_density(role, record.shape, inv.num_experts, inv.top_k, batch)


def is_dense(role: Role) -> bool:
    """Read in full by every token: not a routed expert nor a lookup table. Lookup tables and routed experts go
    before dense tensors of equal density: at a large batch an expert's density rounds to 1.0 in floating point,
    and dense tensors declared first must still not overtake it."""
    return role not in (Role.ROUTED_EXPERT, Role.EMBEDDING)


def expert_axis(role: str, shape: Sequence[int], nbytes: int, experts: int | None,
                module_class: str | None = None) -> int:
    """E for a fused routed-expert tensor [E, ...] that can be offloaded expert by expert, else 0.

    module_class: the owning module's class (an inventory record's); only a fused experts module's tensors have
    an expert axis. None: not known (a saved plan's tensor), judged from role, shape and bytes alone."""
    e = experts
    if role != Role.ROUTED_EXPERT or not e or e < 2 or len(shape) < 2 or shape[0] != e:
        return 0
    if module_class is not None and "Experts" not in module_class:
        return 0
    return e if nbytes % e == 0 else 0


def record_expert_axis(record: TensorRecord, role: Role, inv: Inventory) -> int:
    """expert_axis of one inventory record."""
    return expert_axis(role, record.shape, record.bytes, inv.num_experts, record.module_class)
