"""Write a checkpoint exactly as `save_pretrained` lays it out, one tensor at a time, from a meta-device model.

`save_pretrained` needs every weight in memory at once, and make-tiny used to go through it twice for half
precision (5.9x a model's bytes in RSS). Here the model exists only on the meta device. The files are planned
from shapes alone by transformers' own save-time steps run on meta tensors (keys ignored on save, tied-weight
removal, the reverse of the checkpoint conversion mapping, the hub's shard split), so key names, shapes,
dtypes, shard files and `model.safetensors.index.json` are what `save_pretrained` writes for that model. Then
each tensor in turn is materialized in float32, initialised by the model's own `_init_weights`, cast to its
stored dtype, converted to its on-disk names, written at its planned offset and freed: peak memory is about
three times the largest tensor, whatever the model's size.

The shard files are byte-identical to what `safetensors.torch.save_file` writes for the same tensors (same
header, same data order), only written with positional writes instead of from one in-memory dict.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn

from .safetensors import SAFETENSORS_DTYPES

__all__ = ["meta_model", "save_streaming", "shard_header", "DEFAULT_MAX_SHARD_SIZE"]

DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default: every model make-tiny writes is one file
_ST_NAME = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# The order safetensors lays tensors out in a file: by dtype (this rank), then by name. Wider types first keeps
# every tensor aligned to its element size.
_DATA_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3",
               "F8_E5M2", "I8", "U8", "BOOL")
_WRITE_CHUNK = 16 << 20  # bytes per write of a non-contiguous tensor: bounds the temporary copy


def meta_model(auto_cls, config, dtype: torch.dtype) -> nn.Module:
    """The model `auto_cls.from_pretrained(..., dtype=dtype)` would build for `config`, on the meta device.

    The dtypes are from_pretrained's: `dtype`, except where its dtype plan keeps modules in float32
    (`_keep_in_fp32_modules` for float16, `_keep_in_fp32_modules_strict` for both half types)."""
    from transformers.core_model_loading import build_glob_alternation

    with torch.device("meta"):
        model = auto_cls.from_config(config, dtype=dtype)
    plan = model._get_dtype_plan(dtype)
    if plan:
        alternation, group_of, _ = build_glob_alternation(list(plan))
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            match = alternation.search(name)
            if match is not None and t.is_floating_point():
                kept = t.to(plan[group_of[match.lastgroup]])
                _put(model, name, nn.Parameter(kept, requires_grad=t.requires_grad)
                     if isinstance(t, nn.Parameter) else kept)
    return model


def _put(model: nn.Module, name: str, t: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    (module._parameters if leaf in module._parameters else module._buffers)[leaf] = t


@dataclass(frozen=True)
class _Entry:
    file: int          # index into the open shard files
    start: int         # absolute byte offset in that file
    shape: tuple[int, ...]
    dtype: torch.dtype


def shard_header(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(the bytes before the data: length + JSON header, name -> (start, end) within the data) of a
    safetensors file holding `tensors` (name -> (dtype, shape)), laid out as safetensors itself does."""
    order = sorted(tensors, key=lambda k: (_DATA_ORDER.index(_ST_NAME[tensors[k][0]]), k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    spans, cursor = {}, 0
    for key in order:
        dtype, shape = tensors[key]
        n = math.prod(shape) * dtype.itemsize
        spans[key] = (cursor, cursor + n)
        header[key] = {"dtype": _ST_NAME[dtype], "shape": list(shape), "data_offsets": [cursor, cursor + n]}
        cursor += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, spans


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_tensor(fd: int, offset: int, t: torch.Tensor) -> None:
    """Write `t`'s bytes (row-major) at `offset`; a non-contiguous view goes out in bounded row chunks."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        _pwrite_all(fd, t.reshape(-1).view(torch.uint8).numpy(), offset)
        return
    rows = max(1, _WRITE_CHUNK // max(1, t[0].numel() * t.element_size()))
    for i in range(0, t.shape[0], rows):
        part = t[i:i + rows].contiguous()
        _pwrite_all(fd, part.reshape(-1).view(torch.uint8).numpy(), offset)
        offset += part.numel() * part.element_size()


def _slots(model: nn.Module) -> dict[int, list[tuple[str, str, bool]]]:
    """id(tensor) -> every (module path, attribute, is_parameter) that holds it (tied weights hold one tensor)."""
    slots: dict[int, list[tuple[str, str, bool]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in table.items():
                if t is not None:
                    slots.setdefault(id(t), []).append((path, leaf, is_param))
    return slots


def _init_chain(model: nn.Module, paths: list[str]) -> list[tuple[nn.Module, nn.Module]]:
    """(module, the PreTrainedModel whose `_init_weights` applies to it) for the modules holding a tensor and
    all their ancestors, deepest first: `initialize_weights` visits children before parents, so a parent's
    init of a child's tensor wins, and a sub-model (a vision tower) uses its own `_init_weights`."""
    from transformers import PreTrainedModel

    chain: dict[str, tuple[int, nn.Module, nn.Module]] = {}
    for path in paths:
        parts = path.split(".") if path else []
        module, owner = model, model
        steps = [("", model, model)]
        for i, part in enumerate(parts):
            module = module.get_submodule(part)
            if isinstance(module, PreTrainedModel):
                owner = module
            steps.append((".".join(parts[:i + 1]), module, owner))
        for depth, (p, m, o) in enumerate(steps):
            chain[p] = (depth, m, o)
    return [(m, o) for _, m, o in sorted(chain.values(), key=lambda v: -v[0])]


def save_streaming(model: nn.Module, dest: str | os.PathLike, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                   progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """Write `model` (a PreTrainedModel on the meta device, e.g. from `meta_model`) to `dest` as
    `save_pretrained(dest, max_shard_size=...)` would, with weights drawn by its own `_init_weights` from
    torch's current RNG (seed it first). Writes config.json, generation_config.json (when the model can
    generate), the safetensors files and, when sharded, model.safetensors.index.json. `progress(done, total, key)`
    (bytes) is called after each stored tensor. Returns the safetensors files written. On an error the files
    are left half-written: write into a scratch folder and rename it into place (as make_tiny does)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from transformers import initialization as init
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    dest = Path(dest)
    # save_pretrained's state-dict steps, on meta tensors: the names and shapes of what it would store.
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    planned = revert_weight_conversion(model, dict(state))

    def base(t: torch.Tensor) -> torch.Tensor:  # the in-memory tensor a stored tensor is a view of
        return t._base if t._base is not None else t

    # save_pretrained splits real tensors, grouping views of one storage (the per-expert slices of a fused
    # tensor) into one shard and counting that storage once; meta tensors have no storage, so the same grouping
    # is made by the views' base tensor.
    split = split_state_dict_into_shards_factory(
        planned, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
        get_storage_size=lambda t: base(t).numel() * base(t).element_size(), get_storage_id=lambda t: id(base(t)))

    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(dest)
    if model.can_generate():
        model.generation_config.save_pretrained(dest)

    files = list(split.filename_to_tensors)
    entries: dict[str, _Entry] = {}
    fds: list[int] = []
    try:
        for i, name in enumerate(files):
            tensors = {k: (planned[k].dtype, tuple(planned[k].shape)) for k in split.filename_to_tensors[name]}
            head, spans = shard_header(tensors, {"format": "pt"})
            fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fds.append(fd)
            _pwrite_all(fd, head, 0)
            os.ftruncate(fd, len(head) + max((e for _, e in spans.values()), default=0))
            for key, (start, _) in spans.items():
                dtype, shape = tensors[key]
                entries[key] = _Entry(file=i, start=len(head) + start, shape=shape, dtype=dtype)
        slots = _slots(model)
        trim = _heap_trimmer()
        written: set[str] = set()
        done, total = 0, sum(math.prod(e.shape) * e.dtype.itemsize for e in entries.values())
        with torch.no_grad(), init.guard_torch_init_functions():
            for key in state:
                meta = model.get_parameter_or_buffer(key)
                stored = revert_weight_conversion(model, {key: _materialize(model, key, meta, slots)})
                while stored:
                    name, t = stored.popitem()
                    entry = entries.get(name)
                    if entry is None or name in written or (tuple(t.shape), t.dtype) != (entry.shape, entry.dtype):
                        raise RuntimeError(
                            f"streaming save of {key} produced {name} {tuple(t.shape)} {t.dtype}, which is not what "
                            f"save_pretrained stores ({entry}); this transformers version converts tensors across "
                            "modules: write the model with save_pretrained instead")
                    _write_tensor(fds[entry.file], entry.start, t)
                    written.add(name)
                    done += t.numel() * t.element_size()
                    if progress is not None:
                        progress(done, total, name)
                    del t
                trim()
        missing = set(entries) - written
        if missing:
            raise RuntimeError(f"streaming save wrote no data for {sorted(missing)[:5]}: save_pretrained stores them")
    finally:
        for fd in fds:
            os.close(fd)
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [dest / name for name in files]


def _heap_trimmer() -> Callable[[], None]:
    """glibc keeps freed blocks smaller than its mmap threshold (which grows to 32 MiB after large frees) in the
    heap instead of returning them, so RSS would creep by a tensor's size from one layer to the next;
    `malloc_trim(0)` after each tensor hands them back. A no-op on other C libraries."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lambda: libc.malloc_trim(0) and None
    except (OSError, AttributeError):
        return lambda: None


def _materialize(model: nn.Module, key: str, meta: torch.Tensor,
                 slots: dict[int, list[tuple[str, str, bool]]]) -> torch.Tensor:
    """The stored value of in-memory tensor `key`: materialized in float32 (half-precision checkpoints are then
    roundings of the float32 one), initialised by the model's `_init_weights` while every other tensor stays on
    the meta device (its init ops are no-ops there), cast to the stored dtype; the model keeps the meta tensor."""
    places = slots[id(meta)]
    floating = meta.is_floating_point()
    # NaN marks what no init wrote: a tensor that the family's _init_weights leaves alone is an error, never
    # uninitialised memory in a checkpoint.
    real = torch.full(meta.shape, math.nan, dtype=torch.float32) if floating else \
        torch.zeros(meta.shape, dtype=meta.dtype)
    held = nn.Parameter(real, requires_grad=meta.requires_grad) if isinstance(meta, nn.Parameter) else real
    modules = {path: model.get_submodule(path) for path, _, _ in places}
    for path, leaf, is_param in places:
        (modules[path]._parameters if is_param else modules[path]._buffers)[leaf] = held
    try:
        for module, owner in _init_chain(model, list(modules)):
            owner._init_weights(module)
        now = modules[places[0][0]]._parameters.get(places[0][1]) if places[0][2] else \
            modules[places[0][0]]._buffers.get(places[0][1])
        if now is not held:  # an init that rebinds instead of writing in place
            real = now.detach()
    finally:
        for path, leaf, is_param in places:
            (modules[path]._parameters if is_param else modules[path]._buffers)[leaf] = meta
    if floating and any(bool(part.isnan().any()) for part in real.reshape(-1).split(1 << 22)):
        raise RuntimeError(f"{key}: {type(model).__name__}._init_weights left it (partly) unset; the streaming "
                           "writer cannot draw its values: write this model with save_pretrained")
    return real.detach().to(meta.dtype)
