"""The prefetch read strategy: offloaded weights are copied to reused device buffers before they are used (pinned
host memory, asynchronous copies on a side stream where there is one).

An embedding lookup stages only the rows it reads (its ids read to the host once) and is renumbered onto them; a
decoder layer's offloaded dense tensors go through the two-slot ring of dense_prefetch.py, the next module copied
while this one runs; the experts function gathers the selected experts (experts.py). Staged copies are bound to
one Parameter per slot (StagedParameters), rebound each call.
"""

from __future__ import annotations

import torch.nn as nn

from .dense_prefetch import DenseRing
from .read_backend import ReadBackend
from .read_plan import Counter, LookupRead


class PrefetchReads(ReadBackend):
    name = "prefetch"
    in_place = False
    wants_views = False

    def __init__(self):
        self.ring: DenseRing | None = None   # made at the first offloaded dense module

    def describe(self) -> str:
        return "prefetch: pinned host memory copied to reused device buffers on a side stream"

    def hook_embedding(self, rt, mod: nn.Embedding) -> None:
        host = mod.weight
        rt.hook_staged_embedding(mod, lambda rows: rt.stage_rows(host, rows, key="embedding"),
                                 LookupRead(Counter.LINK, host[0].numel() * host.element_size()))

    def hook_dense(self, rt, mod_name: str, mod: nn.Module, paths: list[str], nbytes: int) -> None:
        if self.ring is None:
            self.ring = DenseRing(rt)
        self.ring.add(mod, paths, nbytes, mod_name)

    def invalidate(self) -> None:
        if self.ring is not None:
            self.ring.invalidate()

    def release(self) -> None:
        """Drop the ring's cached host tensors (detach: weights may be re-registered); the next attach makes a new
        ring."""
        if self.ring is not None:
            self.ring.release()
            self.ring = None
