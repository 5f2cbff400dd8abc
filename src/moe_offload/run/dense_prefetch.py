"""Offloaded dense tensors staged for the prefetch backend: a ring of two reused device buffers, one module ahead.

The runtime (runtime.py) hands every decoder layer's offloaded dense tensors (attention, dense MLPs, norms) to
one `DenseRing` when the backend is `prefetch`; the uva backend reads them in place instead. Each group is
read in full per call, counted in the runtime's link counter (state.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .read_plan import Counter, WholeRead
from .state import RunState
from ..storage.host import set_tensor


class DenseRing:
    """Stages offloaded dense tensors into a ring of two reused device buffers.

    Module j runs from ring slot s while module j+1 (the module that followed j last time)
    is copied into slot 1-s on a side stream (CUDA). The side stream waits until the
    compute stream has finished with slot 1-s; the compute stream waits until the copy has
    landed. Without CUDA (or for the first call) the copy is made in line. Device memory
    used: two slots of the largest module's offloaded bytes.
    """

    def __init__(self, runtime: RunState):
        self.rt = runtime
        self.ring: list[torch.Tensor | None] = [None, None]
        self.staged: list[tuple[int, list[torch.Tensor]] | None] = [None, None]   # (module id, views)
        self.ready: list = [None, None]
        self.free: list = [None, None]
        self.order: dict[int, nn.Module] = {}   # module id -> module that ran after it
        self.modules: dict[int, tuple[nn.Module, list[str], int]] = {}
        self.hosts: dict[int, dict[str, torch.Tensor]] = {}   # module id -> its host tensors, noted at its first call
        self.last: int | None = None
        self.slot = 0
        self.names: dict[int, str] = {}
        self.slot_bytes = 0                     # bytes of one ring slot: the largest group's aligned tensors
        self.outer: set[int] | None = None      # modules that contain other staged modules (see pre)

    def add(self, mod: nn.Module, locals_: list[str], nbytes: int, name: str = "") -> None:
        self.modules[id(mod)] = (mod, locals_, WholeRead(Counter.LINK, nbytes))
        aligned = sum(-(-tensor_at(mod, n).numel() * tensor_at(mod, n).element_size() // 16) * 16 for n in locals_)
        self.slot_bytes = max(self.slot_bytes, aligned)
        self.names[id(mod)] = name
        self.rt.handles.append(mod.register_forward_pre_hook(self.pre))
        self.rt.handles.append(mod.register_forward_hook(self.post))

    def _copy_into(self, slot: int, mod: nn.Module, locals_: list[str]) -> list[torch.Tensor]:
        hosts = [self.hosts[id(mod)][n] for n in locals_]
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
        _, locals_, read = self.modules[id(mod)]
        read.charge(self.rt)                                  # read in full, every call
        if id(mod) not in self.hosts:
            self.hosts[id(mod)] = {n: tensor_at(mod, n) for n in locals_}
        if self.outer is None:
            self.outer = {i for i, name in self.names.items()
                          if any(o != i and other.startswith(f"{name}." if name else "")
                                 for o, other in self.names.items())}
        if id(mod) in self.outer:
            # Its tensors (gpt-oss attention `sinks`) stay in use while the staged modules inside it run
            # through the ring, so they get buffers of their own instead of a ring slot.
            for n in locals_:
                h = self.hosts[id(mod)][n]
                v = self.rt.buffer(("module", id(mod), n), tuple(h.shape), h.dtype)
                v.copy_(h, non_blocking=True)
                self.rt.staged_params.put(mod, n, v)
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
            self.rt.staged_params.put(mod, n, v)
        self._prefetch_next(mod)
        return None

    def _prefetch_next(self, mod) -> None:
        stream = self.rt.stream
        nxt = self.order.get(id(mod))
        if stream is None or not nxt:
            return
        other = 1 - self.slot
        nxt_mod, nxt_locals, _ = self.modules[nxt[0]]
        if id(nxt_mod) not in self.hosts:
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
            set_tensor(mod, n, self.hosts[id(mod)][n])
        if id(mod) in (self.outer or ()):
            return
        if self.rt.stream is not None:
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
        self.hosts.clear()


def tensor_at(mod: nn.Module, path: str) -> torch.Tensor:
    """The tensor at dotted `path` under `mod`."""
    owner, _, name = path.rpartition(".")
    return getattr(mod.get_submodule(owner) if owner else mod, name)
