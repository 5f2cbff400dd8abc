"""The uva read strategy: offloaded weights are read where they lie, by kernels that index host memory mapped for
the device (pinned, `cudaHostRegister`ed slabs seen through UVA views; on a CPU-only machine, ordinary memory).

Nothing is copied: an embedding lookup reads its rows in place, a dense module's kernels read its tensors in
place, and the experts function indexes the selected experts of whole host tensors in place. What crosses the
link is counted on the device (state.distinct: the distinct rows a lookup reads) or from sizes (a dense module
reads all of its offloaded bytes per call), so nothing here waits on the device.
"""

from __future__ import annotations

import torch.nn as nn

from .read_backend import ReadBackend
from .read_plan import Counter, LookupRead, WholeRead
from .state import distinct


class UvaReads(ReadBackend):
    name = "uva"
    in_place = True
    wants_views = True

    def describe(self) -> str:
        return "uva: kernels read mapped pinned host memory in place"

    def hook_embedding(self, rt, mod: nn.Embedding) -> None:
        host = mod.weight
        read = LookupRead(Counter.LINK, host[0].numel() * host.element_size())

        def pre(m, args):
            read.charge(rt, distinct(args[0], host.shape[0]))   # only the distinct rows cross the link

        rt.handles.append(mod.register_forward_pre_hook(pre))

    def hook_dense(self, rt, mod_name: str, mod: nn.Module, paths: list[str], nbytes: int) -> None:
        read = WholeRead(Counter.LINK, nbytes)
        rt.handles.append(mod.register_forward_pre_hook(lambda m, a: read.charge(rt)))
