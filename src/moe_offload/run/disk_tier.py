"""The disk tier at run time: tensors the plan leaves on disk are read from the checkpoint's own safetensors
files (disk.py) when the model runs, never at load, never copied to another folder.

The loader builds a `DiskTier` from the plan and the checkpoint's slots (layouts.py): for each disk-tier
in-memory tensor, the checkpoint tensors that fill it (`DiskTensor.pieces`: reader + Slot). The model holds a
meta placeholder of the tensor's shape (no memory); the runtime reads:

- routed experts: only the experts the router selected (`DiskTensor.read_rows`), into the runtime's reused
  row buffers (or, on an accelerator, into pinned staging buffers sized for one tensor's E experts, then
  copied): one read per checkpoint tensor of each selected expert, adjacent ones coalesced by the reader;
  a fused on-disk tensor `[E, ...]` is read by runs of consecutive expert ids;
- the input embedding: the rows of the distinct token ids of the call;
- a quantized routed-expert tensor (FP8, MXFP4; quant_weights.py): as stored, two disk tensors read alike, its
  values and its scales (an expert's rows of both), never dequantized into memory (quantized dense weights stay
  off the disk tier);
- every other (dense) tensor: whole, per decoder layer, one layer ahead on a background thread
  (disk_prefetch.DensePrefetcher: two slots of the largest layer's dense disk bytes).

Bytes are counted in the runtime's `disk_counter` (a state.LinkCounter beside the host link's), with the same
definition as accounting.py's `disk_read_bytes_per_token`: bytes // E per selected expert, one row per
distinct token id, dense tensors in full. The readers' own `bytes_read` (alignment included) and
`read_calls` are what the disk really delivered. A checkpoint file changed or cut short after load is a
CheckpointError at the read (disk.py).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn

from ..storage.disk import SafetensorsReader, checkpoint_readers
from ..storage.mapped import MappedReader
from ..storage.disk_tensor import DiskTensor
from ..storage.disk_prefetch import DensePrefetcher
from ..errors import CheckpointError, MoeOffloadError
from ..model.inventory import layer_prefix
from ..formats.layouts import Slot
from .read_plan import Counter, LookupRead, WholeRead
from .state import RunState
from ..planning.placement import Tier
from ..formats.quant import QuantFormat
from ..formats.quant_codecs import SCALE_SUFFIX
from .quant_weights import MXFP4_BLOCKS, MXFP4_SCALES, QuantLayout, Reader
from ..storage.host import HostArena, set_tensor

if TYPE_CHECKING:
    from ..planning.placement import Plan


# Selected experts' reads issued at once (one per expert and file, each with its own O_DIRECT bounce buffer from
# the readers' shared pool): a disk serves a few requests in flight faster than one at a time.
READS_IN_FLIGHT = 4


class DiskTier:
    """The disk-tier tensors of one loaded model, their readers, staging and prefetching."""

    def __init__(self, tensors: dict[str, DiskTensor], readers: list[SafetensorsReader], device: torch.device):
        self.tensors = tensors
        self.readers = readers
        self.device = device
        self.prefetcher: DensePrefetcher | None = None
        self.notes: list[str] = []
        # Accelerator only: pinned staging the selected experts land in before their copy to the device, one
        # buffer per tensor sized for all its E experts (exact, pinned in place: storage.HostArena).
        self._arena = HostArena(device, want_uva=False) if device.type != "cpu" else None
        self._staging: dict[tuple, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=READS_IN_FLIGHT, thread_name_prefix="moe-offload-disk-experts")

    @classmethod
    def build(cls, folder: Path, plan: "Plan", slots: dict[str, Slot], device: torch.device,
              quant: dict | None = None, tied=(), disk_read: str = "direct") -> "DiskTier | None":
        """`disk_read`: "direct" (O_DIRECT where the filesystem allows it, else buffered reads that release their
        pages) or "mmap" (storage/mapped.py: the page cache decides what stays)."""
        on_disk = {t.name: t for t in plan.tensors if t.tier == Tier.DISK}
        if not on_disk:
            return None
        quant = {n: q for n, q in (quant or {}).items() if n in on_disk}
        linear = sorted(n for n, q in quant.items() if q.reader is not Reader.EXPERTS)
        if linear:
            raise MoeOffloadError(f"the plan puts {len(linear)} quantized Linear weight(s) on disk (first: "
                                  f"{linear[0]}); the disk tier reads quantized routed experts, not quantized dense "
                                  "weights: plan with --host-memory (or --device-memory) large enough for them")
        shared = sorted({n for pair in tied for n in pair} & set(on_disk))
        if shared:
            raise MoeOffloadError(f"the plan puts {shared[0]} on disk, but it is tied to another tensor (a tied "
                                  "embedding and LM head); the disk tier reads untied tensors only so far: plan it on "
                                  "the host or device (e.g. --offload-params experts)")
        spanning = [n for n, t in on_disk.items()
                    if getattr(t, "disk_expert_ids", ()) and set(t.disk_expert_ids) != set(t.host_ids)]
        if spanning:
            t = on_disk[spanning[0]]
            raise MoeOffloadError(f"the plan puts experts of {t.name} in host memory and others on disk (disk: "
                                  f"{list(t.disk_expert_ids)[:8]}, off the device: {list(t.host_ids)[:8]}); one "
                                  "tensor split across three tiers is not loadable yet: plan with --host-memory "
                                  "that holds whole tensors, or put all of its offloaded experts on one tier")
        by_key, readers = checkpoint_readers(folder, reader=MappedReader if disk_read == "mmap" else None,
                                             in_flight=READS_IN_FLIGHT)
        try:
            pieces: dict[str, list] = {name: [] for name in on_disk}
            for key, slot in slots.items():
                if slot.target in pieces:
                    pieces[slot.target].append((by_key.get(key), slot))   # None: a quantized owner key
            tensors = {}
            for name, t in on_disk.items():
                if not pieces[name]:
                    raise CheckpointError(f"{folder}: no checkpoint tensor fills {name}, which the plan puts on "
                                          "disk; the disk tier reads tensors from the checkpoint: plan it on the "
                                          "host or device")
                if name in quant:   # held as stored: its values and its scales, two tensors read alike
                    tensors.update(_stored(quant[name], pieces[name], by_key, t.experts))
                    continue
                dtype = _dtype(t.dtype)
                routed = t.role == "routed_expert" and t.experts and len(t.shape) >= 2 and t.shape[0] == t.experts
                tensors[name] = DiskTensor(name, tuple(t.shape), dtype, tuple(pieces[name]),
                                           t.experts if routed else None)
        except BaseException:
            for r in readers:
                r.close()
            raise
        return cls(tensors, readers, device)

    # --- report ---------------------------------------------------------------------------
    @property
    def mechanism(self) -> str:
        kinds = sorted({r.mechanism for r in self.readers})
        return "disk tier read in place from the checkpoint, " + "; ".join([*kinds, *self.notes])

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    @property
    def read_calls(self) -> int:
        return sum(r.read_calls for r in self.readers)

    @property
    def staging_bytes(self) -> int:
        """Host memory the disk tier holds for reading: prefetch slots, pinned staging, O_DIRECT bounces."""
        pool = self.prefetcher.pool_bytes if self.prefetcher is not None else 0
        return pool + sum(b.numel() * b.element_size() for b in self._staging.values()) + \
            sum(r.bounce_bytes for r in self.readers)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self._pool.shutdown(wait=True)
        for r in self.readers:
            r.close()
        if self._arena is not None:
            self._arena.release()

    # --- experts: the read plan's executor (read_executor.py) lands their rows with these ------------------
    def read_into(self, src: DiskTensor, ids: list[int], rows: torch.Tensor, positions: list[int]) -> None:
        """rows[positions[j]] = expert ids[j]'s row, read from the checkpoint straight into place (`rows` on the cpu):
        one read of a run of consecutive positions, else one per expert, READS_IN_FLIGHT at once."""
        first = positions[0]
        if positions == list(range(first, first + len(ids))):
            src.read_rows(ids, rows[first:first + len(ids)], self._pool)
            return
        for job in [self._pool.submit(src.read_rows, [e], rows[p:p + 1]) for e, p in zip(ids, positions)]:
            job.result()            # re-raises a read's CheckpointError here

    def submit(self, job) -> Future:
        """One read job on the tier's readers' threads (a streamed step's expert rows: streamed.py)."""
        return self._pool.submit(job)

    def _read_rows(self, src: DiskTensor, ids: list[int], out: torch.Tensor, key: str) -> None:
        if out.device.type == "cpu":
            src.read_rows(ids, out, self._pool)
            return
        # Expert tensors: pinned staging for all E experts, reused. A lookup table's rows (as many as the call's
        # distinct tokens, of a table far larger) go through a temporary of their own size instead.
        stage = self.staging(key, src)[:len(ids)] if src.experts is not None else \
            torch.empty((len(ids), *src.shape[1:]), dtype=src.dtype)
        src.read_rows(ids, stage, self._pool)
        out.copy_(stage)        # synchronous: the staging buffer is reused by the next read

    def staging(self, key: str, src: DiskTensor) -> torch.Tensor:
        """The pinned host buffer [E, ...] an expert tensor's rows land in before their copy to the device (reused)."""
        k = ("pinned", key, src.shape[1:], src.dtype)
        buf = self._staging.get(k)
        if buf is None:
            shape = (src.shape[0], *src.shape[1:])
            buf = self._arena.allocate(f"disk staging {key}", [(key, shape, src.dtype)])[key][0]
            self._staging[k] = buf
        return buf

    # --- dense tensors and the embedding --------------------------------------------------
    def attach_dense(self, rt: RunState, model: nn.Module, experts_modules: set[str]) -> None:
        """Hooks that read every disk-tier tensor outside the experts modules while its module runs."""
        tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
        groups: dict[str, list[tuple[str, DiskTensor]]] = {}
        modules = dict(model.named_modules())
        for name, src in self.tensors.items():
            mod_name, _, local = name.rpartition(".")
            if mod_name in experts_modules or name not in tensors:
                continue
            mod = modules[mod_name]
            if isinstance(mod, nn.Embedding) and local == "weight":
                self._hook_embedding(rt, mod, src)
                continue
            group = layer_prefix(mod_name)
            group = mod_name if group is None else group
            rel = name[len(group):].lstrip(".")
            groups.setdefault(group, []).append((rel, src))
        order = [g for g in modules if g in groups]              # declaration order: the order layers run
        outer = {g for g in order if any(o != g and o.startswith(f"{g}." if g else "") for o in order)}
        fetched = [g for g in order if g not in outer and all(s.prefetchable for _, s in groups[g])]
        slow = [g for g in order if g not in fetched]
        if slow and not self.notes:
            self.notes.append(f"{len(slow)} group(s) of dense disk tensors are read when they run, not ahead "
                              f"(first: {slow[0]}): stored transposed, split or in another dtype, or enclosing "
                              "other groups")
        if self.prefetcher is not None:   # attached again (after a detach): the old slots go
            self.prefetcher.close()
            self.prefetcher = None
        if fetched:
            self.prefetcher = DensePrefetcher([[(s.pieces[0][0], s.pieces[0][1].key) for _, s in groups[g]]
                                               for g in fetched])
        index = {g: i for i, g in enumerate(fetched)}
        for g in order:
            self._hook_group(rt, modules[g], groups[g], index.get(g))

    def _hook_group(self, rt: RunState, mod: nn.Module, members: list[tuple[str, DiskTensor]],
                    index: int | None) -> None:
        read = WholeRead(Counter.DISK, sum(s.nbytes for _, s in members))
        placeholders = [(rel, _get(mod, rel)) for rel, _ in members]

        def pre(m, args):
            read.charge(rt)                                      # dense: read in full, every call
            if index is not None:
                views = self.prefetcher.get(index)
                live = [views[s.pieces[0][1].key] for _, s in members]
            else:
                live = [s.read_whole() for _, s in members]
            for (rel, s), t in zip(members, live):
                if t.device != rt.device:
                    t = t.to(rt.device)
                rt.staged_params.put(m, rel, t)

        def post(m, args, output):
            for rel, ph in placeholders:
                set_tensor(m, rel, ph)

        rt.handles.append(mod.register_forward_pre_hook(pre))
        rt.handles.append(mod.register_forward_hook(post))

    def _hook_embedding(self, rt: RunState, mod: nn.Embedding, src: DiskTensor) -> None:
        def stage(rows: list[int]) -> torch.Tensor:   # only these rows are read
            out = rt.buffer(("rows", "disk-embedding", src.shape[1:], src.dtype), (len(rows), *src.shape[1:]),
                            src.dtype)
            self._read_rows(src, rows, out, "disk-embedding")
            return out

        rt.hook_staged_embedding(mod, stage, LookupRead(Counter.DISK, src.row_bytes))


def _stored(q: QuantLayout, pieces: list, by_key: dict, experts: int) -> dict[str, DiskTensor]:
    """A quantized routed-expert tensor on disk as the two tensors it is held as (quant_weights.py): its values
    (FP8 e4m3, or MXFP4's uint8 blocks) and its scales, each read by expert from the checkpoint tensors that hold
    them, placed by the values' slots (an expert's scale rows go where its value rows go)."""
    fp8 = q.format is QuantFormat.FP8
    values, scales = [], []
    for _, slot in pieces:
        v = slot.key if fp8 else slot.key + MXFP4_BLOCKS
        s = slot.key + SCALE_SUFFIX if fp8 else slot.key + MXFP4_SCALES
        if v not in by_key or s not in by_key:
            raise CheckpointError(f"{q.name} is held as {q.format.value} but the checkpoint lacks {v if v not in by_key else s}; "
                                  "the checkpoint is incomplete")
        values.append((by_key[v], dataclasses.replace(slot, key=v)))
        scales.append((by_key[s], dataclasses.replace(slot, key=s, target=q.scale_name)))
    return {q.name: DiskTensor(q.name, q.data_shape, q.data_dtype, tuple(values), experts),
            q.scale_name: DiskTensor(q.scale_name, q.scale_shape, q.scale_dtype, tuple(scales), experts)}


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """What the model holds for a disk-tier tensor between reads: its shape and dtype, no memory."""
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise MoeOffloadError(f"the disk tier cannot hold a {name} tensor; plan it on the host or device")
    return dt


def _get(mod: nn.Module, path: str) -> torch.Tensor:
    owner, _, name = path.rpartition(".")
    return getattr(mod.get_submodule(owner) if owner else mod, name)
