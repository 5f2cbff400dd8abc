"""The runtime: how offloaded weights are read while the model runs, and how many bytes that costs.

Two backends, both real on every machine:

- `uva`: kernels read offloaded weights in place, through device-visible views of pinned
  host memory (storage.py). Nothing is copied up front.
- `prefetch`: offloaded dense tensors are copied into reused device buffers before their
  module runs (on a side stream, one module ahead, on CUDA); for routed experts only the
  experts the router selected are staged; offloaded embedding tables are read by rows.

Routed experts are run through an experts function registered with transformers' experts
registry (experts.py), which sees `top_k_index` before any expert weight is touched. It
stages (prefetch) or reads in place (uva) just the selected experts, each from the stack
that holds it when a tensor is split between tiers, then runs the class's own eager forward
on them, so the arithmetic is the model's own. The same function hands the routing of every
call to an optional recorder (`Runtime.recorder`), offloaded or not.

Every backend counts the bytes it reads from the host tier per forward call: that is the
measured link traffic (`LinkCounter`).

An optional device-side expert cache (`Runtime.cache`, device_cache.py) keeps offloaded experts
that decode steps fetched in device memory carved at load; a hit reads nothing over the link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .experts import EXPERTS_IMPL, ExpertsState, Recorder, RoutedCall, is_experts_module, register_experts_function
from ..model.inventory import layer_of, layer_prefix
from .quant_weights import Dequantizer, Reader, byte_split, byte_view, by_module as quant_by_module
from ..storage.host import ExpertSplit, set_tensor

if TYPE_CHECKING:
    from .device_cache import DeviceCache

BACKENDS = ("uva", "prefetch")


@dataclass
class LinkCounter:
    """Bytes read from the host tier, per forward call of the whole model."""

    calls: list[tuple[int, int]] = field(default_factory=list)  # (new tokens per sequence, bytes)
    decode: list[bool] = field(default_factory=list)             # per call: a step on a non-empty KV cache
    _pending: int = 0

    def add(self, nbytes: int) -> None:
        self._pending += int(nbytes)

    def end_call(self, tokens_per_sequence: int, decode: bool | None = None) -> None:
        self.calls.append((tokens_per_sequence, self._pending))
        self.decode.append(tokens_per_sequence == 1 if decode is None else decode)
        self._pending = 0

    def reset(self) -> None:
        self.calls.clear()
        self.decode.clear()
        self._pending = 0

    def discard_pending(self) -> None:
        self._pending = 0

    def decode_bytes_per_token(self, batch: int = 1) -> float:
        """Mean bytes per decoded token over decode steps (one new token per sequence, on a non-empty
        cache: a one-token prompt's prefill is not a decode step), prefill excluded."""
        steps = [b for (n, b), dec in zip(self.calls, self.decode) if n == 1 and dec]
        return sum(steps) / (len(steps) * batch) if steps else 0.0


class Runtime:
    """Holds one loaded model's backend state: host arena, staging buffers, counters and hook handles."""

    def __init__(self, model: nn.Module, *, device: torch.device, backend: str, arena, host_names: dict[str, str],
                 host_tensors: dict[str, torch.Tensor] | None = None, plan=None,
                 splits: dict[str, ExpertSplit] | None = None, recorder: Recorder | None = None,
                 cache: "DeviceCache | None" = None, quant: dict | None = None, disk=None):
        from ..errors import DeviceError

        if backend not in BACKENDS:
            raise DeviceError(f"unknown backend {backend!r}: use uva or prefetch")
        self.model = model
        self.device = device
        self.backend = backend
        self.arena = arena
        self.host_names = dict(host_names)  # in-memory name -> tier ("host"/"disk"), tracked by name
        # name -> the host-memory tensor behind an offloaded weight (the model may hold a uva view of it)
        self.host_tensors = dict(host_tensors or {})
        self.plan = plan                     # the plan applied, for audits after transforms
        # name -> layout (resident stack, host ids) of routed-expert tensors split between tiers by expert
        self.splits = dict(splits or {})
        self.counter = LinkCounter()
        # The disk tier (disk_tier.DiskTier) or None; its reads are counted apart from the host link's.
        self.disk = disk
        self.disk_counter = LinkCounter()
        self.routes: list[tuple[torch.Tensor, int]] = []  # uva: (top_k_index, bytes per expert), counted per call
        # Called with each forward call's routing (RoutedCall) when set; `routed` collects it during the call.
        self.recorder: Recorder | None = recorder
        self.routed: dict[int, torch.Tensor] = {}
        # The device-side expert cache (device_cache.py), or None; it serves decode steps (`cache_step`) only.
        self.cache = cache
        self.cache_step = False
        # name -> quant_weights.QuantLayout of every tensor held quantized (values + scales as stored, in its tier);
        # the dequantizer turns them into the compute dtype on the device right before use.
        self.quant = dict(quant or {})
        self.dequantizer = Dequantizer(device, self.quant) if self.quant else None
        self._handles: list = []
        self._staging: dict[tuple, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # --- mechanism report ----------------------------------------------------------------
    @property
    def mechanism(self) -> str:
        disk = f"; {self.disk.mechanism}" if self.disk is not None else ""
        return self._link_mechanism + disk + (self.dequantizer.mechanism if self.dequantizer is not None else "")

    @property
    def _link_mechanism(self) -> str:
        if self.device.type == "cpu":
            return (f"{self.backend} on cpu: no accelerator, the host tier is ordinary memory "
                    "(time figures measure overhead, not a link)")
        if self.backend == "uva":
            return "uva: kernels read mapped pinned host memory in place"
        return "prefetch: pinned host memory copied to reused device buffers on a side stream"

    @property
    def host_bytes(self) -> int:
        return self.arena.nbytes

    # --- staging -------------------------------------------------------------------------
    def rows_buffer(self, key: str, host: torch.Tensor, count: int) -> torch.Tensor:
        """The reused device buffer [count, *host.shape[1:]] that `key`'s selected rows are gathered into."""
        shape = tuple(host.shape[1:])
        return self._buffer(("rows", key, shape, host.dtype), (count, *shape), host.dtype)

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        need = math.prod(shape)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=dtype, device=self.device)
            self._staging[key] = buf
        return buf[:need].view(shape)

    def stage_split(self, split: ExpertSplit, host: torch.Tensor, selected: torch.Tensor, on_host: torch.Tensor,
                    *, key: str) -> torch.Tensor:
        """Gather the `selected` experts (ascending ids) of a split tensor, in that order: those of the resident
        stack by a device-local gather (no link bytes), those of the host stack `host` (`on_host`) over the link."""
        out = self.rows_buffer(key, host, selected.numel())
        rows = split.row[selected]                                   # [U] row of each expert in its stack
        here = (~on_host).nonzero().squeeze(1)                       # positions in `out` of resident experts
        there = on_host.nonzero().squeeze(1)
        out.index_copy_(0, here, split.resident.index_select(0, rows[here]))
        self._copy_rows(host, rows[there], out, positions=there)
        return out

    def stage_rows(self, host: torch.Tensor, rows: torch.Tensor, *, key: str) -> torch.Tensor:
        """Copy host[rows] into a reused device buffer, one per `key` (a tensor's local name, so two tensors
        staged for the same forward never share one) and row shape, shared by all layers (they run in turn)."""
        out = self.rows_buffer(key, host, rows.numel())
        self._copy_rows(host, rows, out)
        return out

    def _copy_rows(self, host: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                   positions: torch.Tensor | None = None) -> None:
        """out[positions[i]] = host[rows[i]] (positions: 0, 1, ... when not given).

        `host` readable by the device (the cpu, or a uva view of mapped pinned memory): one gather kernel
        that reads the host rows in place. Pinned host memory seen from an accelerator (prefetch): row by
        row, asynchronous DMA, no pageable temporary."""
        if host.device == self.device:
            if positions is None:
                torch.index_select(host, 0, rows, out=out[:rows.numel()])
            else:
                out.index_copy_(0, positions, host.index_select(0, rows))
            return
        pos = range(rows.numel()) if positions is None else positions.tolist()
        for i, r in zip(pos, rows.tolist()):
            out[i].copy_(host[r], non_blocking=True)

    # --- attach / detach -------------------------------------------------------------------
    def attach(self) -> None:
        """Route offloaded reads through this runtime: experts function, embedding and dense hooks."""

        register_experts_function()
        # Buffers too (DeepSeek's e_score_correction_bias), and every name of a tied tensor: a tied LM head
        # reads the offloaded embedding table in full, through its own module.
        tensors = {**dict(self.model.named_parameters(remove_duplicate=False)), **dict(self.model.named_buffers())}
        host_ids = {id(tensors[n]) for n in self.host_names if n in tensors}
        modules = dict(self.model.named_modules())
        by_module: dict[str, list[str]] = {}
        for name, tensor in tensors.items():
            if id(tensor) not in host_ids:
                continue
            mod_name, _, local = name.rpartition(".")
            by_module.setdefault(mod_name, []).append(local)
        experts_modules = []
        quantized = quant_by_module({n: q for n, q in self.quant.items() if q.reader is Reader.EXPERTS})
        states: dict[str, ExpertsState] = {}   # experts module name -> its state, for the device cache
        served: set[str] = set()   # split tensors an experts function will read
        dense_groups: dict[str, list[str]] = {}
        for mod_name, mod in modules.items():
            locals_ = by_module.get(mod_name)
            if is_experts_module(mod):
                # Every experts module gets a state, offloaded or not: the experts function records routing.
                experts_modules.append(mod)
                # float8 values are gathered as their bytes (byte_view): not every device has float8 index kernels
                offl = {n: byte_view(getattr(mod, n)) for n in (locals_ or [])}
                disk = {n: self.disk.tensors[f"{mod_name}.{n}"] for n in mod._parameters
                        if self.disk is not None and f"{mod_name}.{n}" in self.disk.tensors}
                served.update(f"{mod_name}.{n}" for n in disk if f"{mod_name}.{n}" in self.splits)
                split = {n: byte_split(self.splits[f"{mod_name}.{n}"]) for n in offl
                         if f"{mod_name}.{n}" in self.splits}
                served.update(f"{mod_name}.{n}" for n in split)
                num = next((getattr(mod, f) for f in ("num_experts", "num_local_experts") if hasattr(mod, f)), None)
                if num is None and offl:  # fused experts: the leading dim of every per-expert tensor
                    name, t = next(iter(offl.items()))
                    num = split[name].num_experts if name in split else t.shape[0]
                if num is None and disk:
                    num = next(iter(disk.values())).shape[0]
                split.update({n: self.splits[f"{mod_name}.{n}"] for n in disk if f"{mod_name}.{n}" in self.splits})
                mod._moe_offload_state = ExpertsState(self, offl, num or 0, split, layer_of(mod_name),
                                                      quant=quantized.get(mod_name, {}), disk=disk)
                states[mod_name] = mod._moe_offload_state
            elif locals_ and isinstance(mod, nn.Embedding):
                self._hook_embedding(mod, locals_)
            elif locals_:
                # Dense tensors are handled per decoder layer: a layer always runs, while some of its
                # submodules are only read through (Mamba's conv1d weight, read by its mixer, never called).
                group = layer_prefix(mod_name)
                group = mod_name if group is None else group
                rel = mod_name[len(group):].lstrip(".")
                dense_groups.setdefault(group, []).extend(f"{rel}.{n}" if rel else n for n in locals_)
        for group, paths in dense_groups.items():
            self._hook_dense(group, modules[group], paths)
        if self.disk is not None:   # dense and embedding tensors on disk: read while their module runs
            self.disk.attach_dense(self, self.model, {n for n, m in modules.items() if is_experts_module(m)})
        if self.dequantizer is not None:   # after the dense hooks: a staged copy is dequantized, not the host one
            self.dequantizer.hook_linears(self.model, self._handles)
        unserved = sorted(set(self.splits) - served)
        if unserved:
            from ..errors import MoeOffloadError

            raise MoeOffloadError(f"{unserved[0]} is split between tiers but no fused experts module reads it; "
                                  "only routed-expert tensors of an experts module can go in part")
        if self.cache is not None:
            self.cache.attach(states, self.device)
        if experts_modules:
            self.model.set_experts_implementation(EXPERTS_IMPL)
        self._handles.append(self.model.register_forward_pre_hook(self._top_pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._top_post, with_kwargs=True))
        self._experts_modules = experts_modules

    def detach(self) -> None:
        """Remove every hook and cached reference to the weights; attach() builds them afresh."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in getattr(self, "_experts_modules", []):
            mod.__dict__.pop("_moe_offload_state", None)
        dense = self.__dict__.pop("_dense", None)
        if dense is not None:
            dense.release()
        if self.cache is not None:   # weights may change before attach(): cached copies would go stale
            self.cache.drop_all()
        self.routes.clear()
        self.routed.clear()

    def invalidate_staging(self, names=None) -> None:
        """Weights were written in place (update_weights): prefetched copies of them are stale, and so are the
        device cache's copies of the experts of `names` (dotted tensor names; None: of every tensor)."""
        if getattr(self, "_dense", None) is not None:
            self._dense.invalidate()
        if self.cache is not None:
            self.cache.invalidate(names)

    # --- hooks ---------------------------------------------------------------------------
    def _top_pre(self, module, args, kwargs):
        self.routes.clear()  # a call that raised leaves nothing behind for the next one
        self.routed.clear()
        self.counter.discard_pending()
        self.disk_counter.discard_pending()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._tokens = int(ids.shape[1]) if ids is not None and ids.dim() >= 2 else 1
        # transformers 5.24 names the KV cache `cache` (`past_key_values` before): a decode step extends one.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        length = getattr(cache, "get_seq_length", None)
        self._decode = bool(length()) if callable(length) else None
        # The device cache serves the calls the counter counts as decode steps (and a trace records as such).
        self.cache_step = self.cache is not None and (self._decode if self._decode is not None else self._tokens == 1)
        if self.cache_step:
            self.cache.policy.begin_step()   # where a step starts, as replay marks it per decoded token

    def _top_post(self, module, args, kwargs, output):
        for top_k_index, per_expert in self.routes:
            self.counter.add(per_expert * torch.unique(top_k_index).numel())
        self.routes.clear()
        tokens, decode = getattr(self, "_tokens", 1), getattr(self, "_decode", None)
        self.counter.end_call(tokens, decode)
        self.disk_counter.end_call(tokens, decode)
        if self.recorder is not None:
            routed = {layer: index.cpu() for layer, index in sorted(self.routed.items())}
            self.routed.clear()
            self.recorder(RoutedCall(tokens, self.counter.decode[-1], routed))

    def _hook_embedding(self, mod: nn.Embedding, locals_: list[str]) -> None:
        host = mod.weight
        row_bytes = host[0].numel() * host.element_size()

        def pre(m, args):
            (ids,) = args[:1]
            rows = torch.unique(ids)                       # only these rows cross the link
            self.counter.add(rows.numel() * row_bytes)
            if self.backend == "uva":
                return None
            set_tensor(m, "weight", self.stage_rows(host, rows, key="embedding"))
            # padding_idx indexes the full table (it only masks gradients): F.embedding rejects it when it is
            # beyond the staged rows, so it is lifted while the staged table is in place.
            m.padding_idx = None
            return (torch.searchsorted(rows, ids), *args[1:])

        def post(m, args, output):
            if self.backend != "uva":
                set_tensor(m, "weight", host)
                m.padding_idx = padding

        padding = mod.padding_idx
        self._handles.append(mod.register_forward_pre_hook(pre))
        self._handles.append(mod.register_forward_hook(post))

    def _hook_dense(self, mod_name: str, mod: nn.Module, locals_: list[str]) -> None:
        """`locals_`: dotted paths, relative to `mod`, of its offloaded dense tensors (read in full per call)."""
        nbytes = sum(_get(mod, n).numel() * _get(mod, n).element_size() for n in locals_)
        if self.backend == "uva":
            self._handles.append(mod.register_forward_pre_hook(lambda m, a: self.counter.add(nbytes)))
            return
        if not hasattr(self, "_dense"):
            self._dense = _DensePrefetcher(self)
        self._dense.add(mod, locals_, nbytes, mod_name)


class _DensePrefetcher:
    """Stages offloaded dense tensors into a ring of two reused device buffers.

    Module j runs from ring slot s while module j+1 (the module that followed j last time)
    is copied into slot 1-s on a side stream (CUDA). The side stream waits until the
    compute stream has finished with slot 1-s; the compute stream waits until the copy has
    landed. Without CUDA (or for the first call) the copy is made in line. Device memory
    used: two slots of the largest module's offloaded bytes.
    """

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.ring: list[torch.Tensor | None] = [None, None]
        self.staged: list[tuple[int, list[torch.Tensor]] | None] = [None, None]   # (module id, views)
        self.ready: list = [None, None]
        self.free: list = [None, None]
        self.order: dict[int, nn.Module] = {}   # module id -> module that ran after it
        self.modules: dict[int, tuple[nn.Module, list[str], int]] = {}
        self.last: int | None = None
        self.slot = 0
        self.names: dict[int, str] = {}
        self.slot_bytes = 0                     # bytes of one ring slot: the largest group's aligned tensors
        self.outer: set[int] | None = None      # modules that contain other staged modules (see pre)

    def add(self, mod: nn.Module, locals_: list[str], nbytes: int, name: str = "") -> None:
        self.modules[id(mod)] = (mod, locals_, nbytes)
        aligned = sum(-(-_get(mod, n).numel() * _get(mod, n).element_size() // 16) * 16 for n in locals_)
        self.slot_bytes = max(self.slot_bytes, aligned)
        self.names[id(mod)] = name
        self.rt._handles.append(mod.register_forward_pre_hook(self.pre))
        self.rt._handles.append(mod.register_forward_hook(self.post))

    def _copy_into(self, slot: int, mod: nn.Module, locals_: list[str]) -> list[torch.Tensor]:
        hosts = [mod._moe_offload_host[n] for n in locals_]
        sizes = [-(-h.numel() * h.element_size() // 16) * 16 for h in hosts]
        buf = self.ring[slot]
        if buf is None:
            # Sized once for the largest group: a slot is never reallocated, so a copy on the side stream can
            # never land in memory the allocator handed out again.
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.rt.device)
            self.ring[slot] = buf
        views, off = [], 0
        for h, size in zip(hosts, sizes):
            v = buf[off:off + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
            v.copy_(h, non_blocking=True)
            views.append(v)
            off += size
        self.staged[slot] = (id(mod), views)
        return views

    def pre(self, mod, args):
        _, locals_, nbytes = self.modules[id(mod)]
        self.rt.counter.add(nbytes)                           # read in full, every call
        if not hasattr(mod, "_moe_offload_host"):
            mod._moe_offload_host = {n: _get(mod, n) for n in locals_}
        if self.outer is None:
            self.outer = {i for i, name in self.names.items()
                          if any(o != i and other.startswith(f"{name}." if name else "")
                                 for o, other in self.names.items())}
        if id(mod) in self.outer:
            # Its tensors (gpt-oss attention `sinks`) stay in use while the staged modules inside it run
            # through the ring, so they get buffers of their own instead of a ring slot.
            for n in locals_:
                h = mod._moe_offload_host[n]
                v = self.rt._buffer(("module", id(mod), n), tuple(h.shape), h.dtype)
                v.copy_(h, non_blocking=True)
                set_tensor(mod, n, v)
            return None
        if self.last is not None and id(mod) not in self.order.get(self.last, ()):
            self.order[self.last] = (id(mod),)
        self.last = id(mod)
        staged = self.staged[self.slot]
        if staged is not None and staged[0] == id(mod):       # prefetched on the side stream for this call
            views = staged[1]
            torch.cuda.current_stream(self.rt.device).wait_event(self.ready[self.slot])
        else:                                                  # copied in line, on the compute stream
            if self.ready[self.slot] is not None:              # after any side-stream copy still landing there
                torch.cuda.current_stream(self.rt.device).wait_event(self.ready[self.slot])
            views = self._copy_into(self.slot, mod, locals_)
        for n, v in zip(locals_, views):
            set_tensor(mod, n, v)
        self._prefetch_next(mod)
        return None

    def _prefetch_next(self, mod) -> None:
        stream = self.rt._stream
        nxt = self.order.get(id(mod))
        if stream is None or not nxt:
            return
        other = 1 - self.slot
        nxt_mod, nxt_locals, _ = self.modules[nxt[0]]
        if not hasattr(nxt_mod, "_moe_offload_host"):
            return
        if self.free[other] is not None:
            stream.wait_event(self.free[other])
        with torch.cuda.stream(stream):
            self._copy_into(other, nxt_mod, nxt_locals)
            self.ready[other] = torch.cuda.Event()
            self.ready[other].record(stream)

    def post(self, mod, args, output):
        _, locals_, _ = self.modules[id(mod)]
        for n in locals_:
            set_tensor(mod, n, mod._moe_offload_host[n])
        if id(mod) in (self.outer or ()):
            return
        if self.rt._stream is not None:
            self.free[self.slot] = torch.cuda.Event()
            self.free[self.slot].record(torch.cuda.current_stream(self.rt.device))
        # A slot's copy serves one call only: the next call copies again (what the link really carries,
        # and never stale after a weight update).
        self.staged[self.slot] = None
        self.ready[self.slot] = None
        # The next module runs from the other slot (where its prefetch went, if any).
        self.slot = 1 - self.slot

    def invalidate(self) -> None:
        """Forget prefetched copies (weights changed under them); the next call copies in line."""
        self.staged = [None, None]
        self.ready = [None, None]

    def release(self) -> None:
        """Drop the cached host tensors of every module (detach: weights may be re-registered)."""
        for mod, _, _ in self.modules.values():
            mod.__dict__.pop("_moe_offload_host", None)


def _get(mod: nn.Module, path: str) -> torch.Tensor:
    owner, _, name = path.rpartition(".")
    return getattr(mod.get_submodule(owner) if owner else mod, name)
