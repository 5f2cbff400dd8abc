"""How a runtime computes a call's selected experts: the class's eager loop, grouped (inductor's gather-GEMV,
grouped.py) or fused (moe-offload's CPU kernels on the stored bytes, fused.py), and the choice a user who names
none gets (`auto`).

`ExpertsCompute` is the choice a runtime holds (no process-global state). `auto` is the fastest correct path
here: fused on a CPU whose kernels build (benchmarks/step_bench.py: the kernels against grouped and eager at
released dimensions), else the eager loop; the runtime's report says which, and why when it is not fused.
"""

from __future__ import annotations

import enum
import sys
import types

import torch
import torch.nn as nn

from .fused import FUSED_MAX_ROWS, fused_experts, supports
from .grouped import GROUPED_MAX_ROWS, RECOMPILE_LIMIT, grouped_experts, original_forward

AUTO = "auto"


class ExpertsMode(str, enum.Enum):
    EAGER = "eager"       # the experts class's own forward (the model's arithmetic)
    GROUPED = "grouped"   # one inductor-compiled gather-GEMV per projection (grouped.py)
    FUSED = "fused"       # moe-offload's CPU kernels, reading the stored format in place (fused.py)


def experts_mode(value) -> ExpertsMode:
    """An explicit mode (`auto` is resolved by `resolve_experts`)."""
    from ..errors import MoeOffloadError

    if isinstance(value, ExpertsMode):
        return value
    try:
        return ExpertsMode(value or ExpertsMode.EAGER.value)
    except ValueError:
        names = " or ".join([m.value for m in ExpertsMode] + [AUTO])
        raise MoeOffloadError(f"experts {value!r}: use {names}") from None


def resolve_experts(value, device: torch.device) -> tuple[ExpertsMode, str | None]:
    """(mode, why not fused) for `value` on `device`. `auto`: fused where the kernels run (a CPU device on which
    they build), else eager, with the reason. An explicit `fused` that cannot run raises (never a silent
    fallback): DeviceError off the CPU, kernels.KernelUnavailable when they do not build."""
    from ..errors import DeviceError
    from ..kernels import KernelUnavailable, kernels

    if value != AUTO:
        mode = experts_mode(value)
        if mode is ExpertsMode.FUSED:
            if device.type != "cpu":
                raise DeviceError(f"--experts fused computes experts with moe-offload's CPU kernels; the model runs "
                                  f"on {device}: use --experts grouped or eager there")
            kernels(progress=_say)
        return mode, None
    if device.type != "cpu":
        return ExpertsMode.EAGER, f"the CPU kernels do not run on {device.type}"
    try:
        kernels(progress=_say)
    except KernelUnavailable as err:
        return ExpertsMode.EAGER, str(err)
    return ExpertsMode.FUSED, None


def _say(line: str) -> None:
    """The kernels' one-time build takes up to a minute: say so on stderr (stdout may carry --json)."""
    print(line, file=sys.stderr, flush=True)


def _own_copy(fn):
    """A copy of `fn` with its own code object: torch.compile keeps its compiled graphs (and its recompile limit)
    per code object, so each runtime's kernels are its own, not shared by every model of the process."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class ExpertsCompute:
    """How a runtime computes a call's selected experts: the class's eager loop, grouped (one compiled gather-GEMV
    kernel per projection, compiled once per shape and kept here) or fused (the CPU kernels)."""

    def __init__(self, mode=ExpertsMode.EAGER, why_not_fused: str | None = None):
        self.mode = experts_mode(mode)
        self.why_not_fused = why_not_fused
        self._kernel = None
        self.isa = None   # the kernels' instruction-set path (fused): resolved once, outside any compiled step
        if self.mode is ExpertsMode.FUSED:
            from ..kernels import best_isa

            self.isa = best_isa()
        self._unsupported: dict[int, str | None] = {}   # id(module) -> why the kernels cannot compute it

    def grouped_for(self, hidden_states: torch.Tensor, decode: bool) -> bool:
        return self.mode is ExpertsMode.GROUPED and decode and hidden_states.size(0) <= GROUPED_MAX_ROWS

    def fused_for(self, module: nn.Module, hidden_states: torch.Tensor, quant=None) -> bool:
        """This call is computed by the CPU kernels (reading quantized experts as stored, nothing dequantized)."""
        if self.mode is not ExpertsMode.FUSED:
            return False
        key = id(module)
        # Decided on a module's first call, whatever its length: a prefill, run eagerly before a compiled decode
        # step is traced, so the step's graph is not guarded on a key it adds (one more compile, on its 2nd step).
        if key not in self._unsupported:
            self._unsupported[key] = supports(module, quant or {})
        return hidden_states.size(0) <= FUSED_MAX_ROWS and self._unsupported[key] is None

    def __call__(self, module: nn.Module, tensors: dict[str, torch.Tensor], hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, view=None,
                 decode: bool = True, quant=None) -> torch.Tensor:
        """`view`: what the eager forward sees as the module (a staged view when tensors were gathered);
        `decode`: the call is a decode step (one new token per sequence); `quant`: local name -> QuantLayout of
        the tensors `tensors` (or the module) hold as stored, for the fused kernels (the caller dequantized them
        for every other path)."""
        if self.fused_for(module, hidden_states, quant):
            return fused_experts(module, tensors, quant or {}, hidden_states, top_k_index, top_k_weights, self.isa)
        if not self.grouped_for(hidden_states, decode):
            return original_forward(module)(module if view is None else view, hidden_states, top_k_index,
                                            top_k_weights)
        if torch.compiler.is_compiling():   # inside a compiled decode step: traced inline
            return grouped_experts(module, tensors, hidden_states, top_k_index, top_k_weights)
        if self._kernel is None:
            self._kernel = torch.compile(_own_copy(grouped_experts), dynamic=False, fullgraph=True)
        for t in tensors.values():   # gathered stacks: their number of experts varies from call to call
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):   # for this call only
            return self._kernel(module, tensors, hidden_states, top_k_index, top_k_weights)

    @property
    def mechanism(self) -> str:
        if self.mode is ExpertsMode.FUSED:
            skipped = sorted({why for why in self._unsupported.values() if why})
            rest = f"; not for {', '.join(skipped)} (eager loop)" if skipped else ""
            return (f"experts: moe-offload's CPU kernels on the stored format ({self.isa.name.lower()} path; calls "
                    f"of up to {FUSED_MAX_ROWS} rows, longer prefills by the eager loop; the dense Linears' alike){rest}")
        why = f" (not the CPU kernels: {self.why_not_fused})" if self.why_not_fused else ""
        if self.mode is ExpertsMode.EAGER:
            return f"experts: the class's eager loop{why}"
        return f"experts: grouped gather-GEMV kernels (calls of up to {GROUPED_MAX_ROWS} rows; prefill eager){why}"
