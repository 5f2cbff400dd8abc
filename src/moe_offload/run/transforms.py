"""Weight transforms that keep the placement.

Engines post-process weights after loading (transpose + contiguous, repacking) and often
re-register the Parameter, dropping attributes set on the old object. Done naively on a
zero-copy view of host memory, `w.transpose(-1, -2).contiguous()` makes a full device copy
and silently de-offloads every expert. Here:

- an offloaded tensor is transformed on the host, written back into its own host bytes
  (or a new exact-size slab when its size changes), and its device-visible view rebuilt:
  it never becomes device-resident, not even transiently;
- a resident tensor takes the ordinary device path;
- placement is tracked by name in the runtime, so a re-registered Parameter keeps it;
- new weights (an RL weight update) are written with `update_weights`, in place, by the
  same rule;
- an audit runs afterwards and raises `AuditError` on any mismatch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import dataclasses

import torch
import torch.nn as nn

from .auditor import audit
from ..errors import AuditError, MoeOffloadError
from ..storage.host import set_tensor
from .runtime import runtime_of

Transform = Callable[[str, torch.Tensor], torch.Tensor]


def _runtime(model: nn.Module):
    runtime = runtime_of(model, required=False)
    if runtime is None:
        raise MoeOffloadError("this model was not loaded by moe_offload.load: there is no placement to keep; "
                              "load it with moe_offload.load(...) first")
    return runtime


def _refuse_disk(runtime, names, what: str) -> None:
    """Disk-tier weights are read from the checkpoint's own files at every use: there is nothing in memory to
    change, and writing the user's checkpoint is not ours to do. Refused before anything is touched."""
    disk = getattr(runtime, "disk", None)
    on_disk = [n for n in names if disk is not None and n in disk.tensors]
    if on_disk:
        raise MoeOffloadError(f"{what} {len(on_disk)} tensor(s) on the disk tier (first: {on_disk[0]}), which are read "
                              "from the checkpoint's safetensors files at run time and so cannot be changed in "
                              "memory; plan them in host memory (a larger --host-memory / device budget) to "
                              "transform or update them")


def _rehost(runtime, name: str, new: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Write `new` (a host tensor) into `name`'s host bytes; returns the tensor the model should hold.

    `visible` is what the model holds now: the host tensor itself, or a uva view of it."""
    host = runtime.host_tensors[name]
    new = new.contiguous()
    nbytes = new.numel() * new.element_size()
    if nbytes == host.numel() * host.element_size() and host.is_contiguous():
        raw = host.reshape(-1).view(torch.uint8)
        raw.copy_(new.reshape(-1).view(torch.uint8))
        host_new = raw.view(new.dtype).view(new.shape)
        if visible.data_ptr() != host.data_ptr() or visible.device != host.device:  # a uva view: rebuild it
            visible = visible.reshape(-1).view(torch.uint8).view(new.dtype).view(new.shape)
        else:
            visible = host_new
    else:  # the size changed: a new exact-size slab
        host_new, visible = runtime.arena.allocate(f"transform:{name}", [(name, tuple(new.shape), new.dtype)])[name]
        host_new.copy_(new)
    runtime.host_tensors[name] = host_new
    return visible


def transform_weights(model: nn.Module, fn: Transform, *, names: Iterable[str] | None = None) -> list[str]:
    """Apply `fn(name, tensor) -> tensor` to the named weights (default: all) of a loaded model.

    Offloaded weights are given to `fn` as host tensors and stay on the host; resident ones
    as device tensors. A routed-expert tensor split between tiers is given to `fn` in its two
    stacks (its experts on the host, then those on the device), so `fn` must act expert by expert
    (e.g. transpose the last two dims) and keep each stack's experts. Returns the names
    transformed. Raises AuditError if anything moved.
    """
    runtime = _runtime(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wanted = list(tensors) if names is None else list(names)
    unknown = [n for n in wanted if n not in tensors]
    if unknown:
        raise MoeOffloadError(f"{len(unknown)} name(s) are not tensors of this model (first: {unknown[:3]})")
    if names is None and getattr(runtime, "disk", None) is not None:
        # every weight: those on disk are skipped, since they have no bytes in memory to transform
        wanted = [n for n in wanted if n not in runtime.disk.tensors]
    _refuse_disk(runtime, wanted, "transform_weights was asked to transform")
    runtime.detach()  # hooks and experts state hold references to the old tensors
    try:
        for name in wanted:
            if name in runtime.host_names:
                with torch.no_grad():
                    new = fn(name, runtime.host_tensors[name])
                    # a split tensor's resident stack, on the device: the same transform, computed before
                    # either stack is replaced so that a failure leaves both as they were
                    part = fn(name, runtime.splits[name].resident) if name in runtime.splits else None
                if new.device.type != "cpu":
                    raise MoeOffloadError(f"the transform moved offloaded {name} to {new.device}; transforms of "
                                          "offloaded weights must stay on the host")
                set_tensor(model, name, _rehost(runtime, name, new, tensors[name]))
                if part is not None:
                    runtime.splits[name] = dataclasses.replace(runtime.splits[name], resident=part)
            else:
                with torch.no_grad():
                    set_tensor(model, name, fn(name, tensors[name]))
    finally:
        runtime.attach()
    _check(model, runtime)
    return wanted


def update_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Write new values into existing weights in place (an RL weight update); placement is kept."""
    runtime = _runtime(model)
    live = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    _refuse_disk(runtime, list(weights), "update_weights was given")
    for name, value in weights.items():
        if name not in live:
            raise MoeOffloadError(f"{name!r} is not a tensor of this model; check the name against named_parameters()")
        target = runtime.host_tensors.get(name, live[name])
        if name in runtime.splits:  # [E, ...]: each expert's row goes to the stack that holds it
            split = runtime.splits[name]
            if tuple(value.shape) != (split.num_experts, *target.shape[1:]):
                raise MoeOffloadError(f"{name}: new value has shape {list(value.shape)}, the weight has "
                                      f"{[split.num_experts, *target.shape[1:]]}; apply the same "
                                      "transforms to the update first")
            with torch.no_grad():
                split.resident.copy_(value[list(split.resident_ids)])
                target.copy_(value[list(split.host_ids)])
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise MoeOffloadError(f"{name}: new value has shape {list(value.shape)}, the weight has "
                                  f"{list(target.shape)}; apply the same transforms to the update first")
        with torch.no_grad():
            target.copy_(value)  # host bytes written on the host, resident ones on the device
    runtime.invalidate_staging(list(weights))   # and the device cache's copies of these tensors' experts
    _check(model, runtime)


def _check(model: nn.Module, runtime) -> None:
    if runtime.plan is not None:
        mismatches = audit(model, runtime.plan)
        if mismatches:
            raise AuditError(mismatches)
