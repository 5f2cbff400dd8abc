"""Checkpoint names -> in-memory names, for the layouts transformers converts at load time.

transformers 5.x keeps routed experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]) while
most checkpoints store one tensor per expert (`mlp.experts.3.gate_proj.weight`), and some
families rename modules (`block_sparse_moe` -> `mlp`, Granite's `input_linear`). Rather
than keep a second copy of those rules, we read transformers' own conversion mapping for
the model and interpret the few operations it uses for MoE layouts. Each checkpoint
tensor gets a `Slot`: which in-memory tensor it lands in and where, so the loader can
write it in place and the inventory can count its bytes.

An operation we do not understand is an error, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from ..errors import CheckpointError


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes in memory.

    target[expert] (or target itself when `expert` is None), cut into `parts` equal chunks
    along `part_dim` (a dim of that slice), receives chunk `part`. `transpose` names two dims
    of the checkpoint tensor to swap first; with `transpose_if_needed` only when the tensor's
    shape does not already fit its place (transformers' `Transpose(check_dims=True)`: Qwen3-VL-MoE
    releases store experts transposed, while save_pretrained writes the in-memory layout).
    """

    key: str
    target: str
    expert: int | None = None
    part: int = 0
    parts: int = 1
    part_dim: int = 0
    transpose: tuple[int, int] | None = None
    transpose_if_needed: bool = False

    @property
    def is_whole(self) -> bool:
        return self.expert is None and self.parts == 1


def _conversions(model: nn.Module):
    # Imported lazily: these are transformers internals that moved between 4.x and 5.x.
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _star_regex(pattern: str) -> re.Pattern:
    # In transformers' source patterns `*` stands for a module-list index.
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


def _slot_from_converter(key: str, renamed: str, target: str, pattern: str, converter) -> Slot:
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    expert = None
    part, parts, part_dim = 0, 1, 0
    transpose = None
    if_needed = False
    merged = False
    for op in converter.operations:
        if isinstance(op, MergeModulelist) and op.dim == 0:
            match = _star_regex(pattern).search(renamed)
            if match is None or not match.groups():
                raise CheckpointError(f"checkpoint key {key!r}: no expert index where {pattern!r} expects one")
            expert = int(match.group(1))
            merged = True
        elif isinstance(op, Concatenate):
            part = converter.source_patterns.index(pattern)
            parts = len(converter.source_patterns)
            part_dim = op.dim - 1 if merged else op.dim
        elif isinstance(op, Transpose):
            transpose = (op.dim0, op.dim1)
            if_needed = bool(getattr(op, "check_dims", False))
        else:
            raise CheckpointError(
                f"checkpoint key {key!r} needs the conversion {type(op).__name__}, which moe-offload cannot "
                "apply in place; load this model with transformers directly, or convert the checkpoint first"
            )
    return Slot(key, target, expert, part, parts, part_dim, transpose, if_needed)


def map_keys(model: nn.Module, keys, *, known: set[str] | None = None) -> dict[str, Slot]:
    """Map each checkpoint key to its `Slot` in `model` (built on any device, meta included).

    `known` is the set of in-memory names (defaults to the model's state_dict keys); it is
    used to add or strip the base-model prefix the way transformers does.
    """
    renamings, converters = _conversions(model)
    if known is None:
        known = set(model.state_dict().keys())
    prefix = getattr(model, "base_model_prefix", "") or ""
    slots: dict[str, Slot] = {}
    for key in keys:
        renamed = key
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        target, pattern, used = renamed, None, None
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                used = converter
                break
        if prefix and target not in known:
            if target.startswith(prefix + ".") and target[len(prefix) + 1 :] in known:
                target = target[len(prefix) + 1 :]
            elif f"{prefix}.{target}" in known:
                target = f"{prefix}.{target}"
        if used is None:
            slots[key] = Slot(key, target)
        else:
            slots[key] = _slot_from_converter(key, renamed, target, pattern, used)
    return slots
