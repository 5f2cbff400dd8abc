"""How offloaded weights reach the compute: the read strategies behind one small base (uva and prefetch, one module
each: read_uva.py, read_prefetch.py), chosen by name once at load (runtime.backend_named); the runtime asks its
strategy, never compares strings.

A strategy answers four questions: may the kernels read whole host tensors in place (`in_place`), does the host
arena need device-visible views of its slabs (`wants_views`), what it says it does (`link_mechanism`), and how an
offloaded embedding table and a decoder layer's offloaded dense tensors are read while their module runs
(`hook_embedding`, `hook_dense`: hooks registered on the runtime's handles, bytes charged to its link counter).
Routed experts it does not read itself: the experts function (experts.py) reads them in place when `in_place` and
nothing else (a split, a cache, a look-ahead, the disk tier) asks for staging, else gathers them.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class ReadBackend:
    """The base: what every strategy answers. Subclasses set `name`, `in_place` and `wants_views`."""

    name = ""
    in_place = False      # the kernels may index whole host tensors of the experts in place
    wants_views = False   # the host arena maps its slabs for the device (uva views)

    def link_mechanism(self, device: torch.device) -> str:
        if device.type == "cpu":
            return (f"{self.name} on cpu: no accelerator, the host tier is ordinary memory "
                    "(time figures measure overhead, not a link)")
        return self.describe()

    def describe(self) -> str:
        raise NotImplementedError

    def hook_embedding(self, rt, mod: nn.Embedding) -> None:
        raise NotImplementedError

    def hook_dense(self, rt, mod_name: str, mod: nn.Module, paths: list[str], nbytes: int) -> None:
        raise NotImplementedError

    def invalidate(self) -> None:
        """Weights were written in place: drop staged copies of them (none by default)."""

    def release(self) -> None:
        """The runtime detaches: drop what was built at attach (nothing by default)."""
