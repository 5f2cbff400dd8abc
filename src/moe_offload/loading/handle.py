"""What `mo.load` returns: the loaded model and its plan, as the pair scripts unpack, and a handle that closes.

    model, plan = mo.load(folder, offload_gb=20)          # as before: the pair
    with mo.load(folder, offload_gb=20) as loaded:        # or a handle with a lifecycle
        loaded.model.generate(...)
    # closed here: workers stopped, hooks removed, host arena and caches freed, the model emptied

`Loaded` is a tuple of (model, plan) with `model`, `plan` and `runtime` by name and `close()`. Closing stops the
runtime's worker threads (look-ahead reads and copies, the disk tier's reads), removes its hooks, drops its
device and host caches and staging buffers, releases the host arena (pinned slabs unpinned) and the disk tier's
files, moves every tensor of the model to the meta device and hands the freed heap back to the OS, so that no
memory stays behind while a script still holds the model (tested: the process's threads, open files and RSS after ten loads and closes). A closed
model cannot run; load it again.
"""

from __future__ import annotations

import gc

import torch.nn as nn

from ..planning.placement import Plan
from ..storage.host import trim_heap
from ..run.runtime import runtime_of, set_runtime


class Loaded(tuple):
    """(model, plan), with the runtime by name and a close() that frees everything the load took."""

    def __new__(cls, model: nn.Module, plan: Plan):
        return super().__new__(cls, (model, plan))

    @property
    def model(self) -> nn.Module:
        return self[0]

    @property
    def plan(self) -> Plan:
        return self[1]

    @property
    def runtime(self):
        """The model's runtime (run/runtime.Runtime): mechanism, counters, caches; None once closed."""
        return runtime_of(self[0], required=False)

    @property
    def closed(self) -> bool:
        return self.runtime is None

    def close(self) -> None:
        """Free what the load took (see the module's docstring). Idempotent."""
        runtime = self.runtime
        if runtime is None:
            return
        runtime.close()
        set_runtime(self[0], None)
        self[0].to("meta")   # resident weights and views of released host memory alike: nothing stays
        gc.collect()         # reference cycles between modules and hooks hold tensors until collected
        trim_heap()

    def __enter__(self) -> "Loaded":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.runtime.mechanism
        return f"Loaded({type(self[0]).__name__}, {len(self[1].tensors)} tensors planned; {state})"
