"""The few named exceptions a user can meet.

Every message says what went wrong, why it matters and how to fix it, with numbers.
The CLI turns any `MoeOffloadError` into one `error:` line on stderr and exit status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MoeOffloadError(Exception):
    """Base class of user errors (bad input, impossible request)."""


class ConfigError(MoeOffloadError):
    """A model config that is missing, malformed or of an unknown family."""


class CheckpointError(MoeOffloadError):
    """A checkpoint that does not match its config: missing shard or key, shape or dtype mismatch, truncation."""


class PlanMismatchError(MoeOffloadError):
    """A plan applied to a model it was not made for: other tensor names, shapes or dtypes."""


class BudgetError(MoeOffloadError):
    """A budget that cannot be met: negative, larger than what may be offloaded, or too small to fit."""


class SelectorError(MoeOffloadError):
    """`offload_params` selectors that match nothing, or options that contradict each other."""


class TraceError(MoeOffloadError):
    """A routing trace that is malformed (file and line named) or does not match the model it is used with."""


class DeviceError(MoeOffloadError):
    """A device that is not there, or a backend that cannot run on it."""


class AuditError(MoeOffloadError):
    """A tensor whose actual placement differs from its planned tier (the silent de-offload class of bugs)."""

    def __init__(self, mismatches):
        self.mismatches = list(mismatches)
        shown = "; ".join(
            f"{m.name}: planned {m.planned}, actually {m.actual} ({m.bytes} bytes)" for m in self.mismatches[:5]
        )
        more = f" and {len(self.mismatches) - 5} more" if len(self.mismatches) > 5 else ""
        total = sum(m.bytes for m in self.mismatches)
        super().__init__(
            f"{len(self.mismatches)} tensor(s) ({total} bytes) are not where the plan put them: {shown}{more}; "
            "a transform or copy moved them, so device memory no longer matches the plan; "
            "apply weight transforms through moe_offload.transform_weights so offloaded tensors stay on the host"
        )
