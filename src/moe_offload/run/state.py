"""What the runtime's readers share while the model runs: counters, staging buffers, hook handles, routing.

`RunState` is the part of a loaded model's runtime that the readers of offloaded weights use: the experts
function (experts.py), the device-side expert cache (device_cache.py), the disk tier (disk_tier.py) and the
dense prefetcher (dense_prefetch.py). It holds

- the device and backend (`uva` or `prefetch`), and how selected experts are computed (`compute`:
  compute.ExpertsCompute: eager, grouped or fused);
- the counters of bytes read per forward call (`LinkCounter`): the host link's and the disk tier's;
- the reused device buffers offloaded rows are staged into, and the row copies that fill them;
- the hook handles every reader registers (removed together at detach);
- the per-call routing state: uva's routes still to count, the routing handed to a recorder (`RoutedCall`),
  and whether this call is a decode step the device cache serves.

`Runtime` (runtime.py) builds on it: it attaches the readers to a model and runs the per-call hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .compute import ExpertsCompute, ExpertsMode
from ..storage.host import StagedParameters, row_runs, set_tensor


class LinkCounter:
    """Bytes read from the host tier, per forward call of the whole model.

    A count may be a device tensor (what the uva path counts on the device: distinct experts, embedding rows), so
    that the step never waits on the device for its own accounting: such counts are read back when the counts are
    read (`calls`), all of them in one read."""

    def __init__(self):
        self._calls: list[tuple[int, "int | torch.Tensor"]] = []   # (new tokens per sequence, bytes)
        self.decode: list[bool] = []             # per call: a step on a non-empty KV cache
        self._pending = 0
        self._pending_device: list[torch.Tensor] = []

    def add(self, nbytes: "int | torch.Tensor") -> None:
        if isinstance(nbytes, torch.Tensor):
            self._pending_device.append(nbytes)
        else:
            self._pending += int(nbytes)

    def end_call(self, tokens_per_sequence: int, decode: bool | None = None) -> None:
        value = self._pending
        if self._pending_device:
            value = torch.stack(self._pending_device).sum() + value
        self._calls.append((tokens_per_sequence, value))
        self.decode.append(tokens_per_sequence == 1 if decode is None else decode)
        self.discard_pending()

    @property
    def calls(self) -> list[tuple[int, int]]:
        lazy = [i for i, (_, b) in enumerate(self._calls) if isinstance(b, torch.Tensor)]
        if lazy:
            values = torch.stack([self._calls[i][1] for i in lazy]).tolist()
            for i, v in zip(lazy, values):
                self._calls[i] = (self._calls[i][0], int(v))
        return self._calls

    def reset(self) -> None:
        self._calls.clear()
        self.decode.clear()
        self.discard_pending()

    def discard_pending(self) -> None:
        self._pending = 0
        self._pending_device = []

    def decode_bytes_per_token(self, batch: int = 1) -> float:
        """Mean bytes per decoded token over decode steps (one new token per sequence, on a non-empty
        cache: a one-token prompt's prefill is not a decode step), prefill excluded."""
        steps = [b for (n, b), dec in zip(self.calls, self.decode) if n == 1 and dec]
        return sum(steps) / (len(steps) * batch) if steps else 0.0


@dataclass(frozen=True)
class RoutedCall:
    """The routing of one forward call of the whole model, as its experts modules saw it."""

    tokens: int                        # new tokens per sequence in this call
    decode: bool                       # a step on a non-empty KV cache (else prefill)
    experts: dict[int, torch.Tensor]   # decoder layer N (model.layers.N) -> top_k_index [sequences * tokens, k], cpu

    @property
    def phase(self) -> str:
        """Every token of a call shares it: `decode` or `prefill`."""
        return "decode" if self.decode else "prefill"


Recorder = Callable[[RoutedCall], None]


class RunState:
    """One loaded model's reading state: device and backend, counters, staging buffers, hook handles, routing."""

    def __init__(self, *, device: torch.device, backend: str, recorder: Recorder | None = None, cache=None,
                 disk=None, dequantizer=None, experts=ExpertsMode.EAGER, host_cache=None, lookahead=None, host_compute=None):
        self.device = device
        self.backend = backend
        self.compute = experts if isinstance(experts, ExpertsCompute) else ExpertsCompute(experts)
        self.counter = LinkCounter()
        # The disk tier (disk_tier.DiskTier) or None; its reads are counted apart from the host link's.
        self.disk = disk
        self.disk_counter = LinkCounter()
        self.activation_counter = LinkCounter()   # of the host link's bytes, the activations host compute sent
        self.routes: list = []    # uva in place: read_plan.InPlaceRead of each layer step, charged at the call's end
        # Called with each forward call's routing (RoutedCall) when set; `routed` collects it during the call.
        self.recorder: Recorder | None = recorder
        self.routed: dict[int, torch.Tensor] = {}
        # The device-side expert cache (device_cache.DeviceCache), or None; it serves decode steps (`cache_step`) only.
        self.cache = cache
        self.cache_step = False
        # The host-memory cache of disk-tier experts (host_cache.HostCache), or None; decode steps look it up (a
        # prefill only stores what it read into its free room: read_plan.plan_step).
        self.host_cache = host_cache
        self.host_cache_step = False
        # run/lookahead.Lookahead (predicted offloaded experts read N layers ahead), or None; decode steps only.
        self.lookahead = lookahead
        # host_compute.HostCompute (offloaded experts computed on the host, as the cost model chooses), or None.
        self.host_compute = host_compute
        self.decode_step = False  # the call under way is a decode step (one new token per sequence, cache not empty)
        self.step_tokens = 1      # new tokens per sequence of the call under way (1: a decode step)
        # quant_weights.Dequantizer of the tensors held quantized, or None: they become the compute dtype on the
        # device right before use.
        self.dequantizer = dequantizer
        self.handles: list = []   # every hook the readers registered, removed at detach
        self.staged_params = StagedParameters()   # the Parameters staged copies are bound to during a call
        self.staged_embeddings: list[nn.Module] = []   # embeddings whose tables are staged by rows for each call
        self._staging: dict[tuple, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def stream(self):
        """The side stream prefetches are copied on (CUDA), or None: copies are then made in line."""
        return self._stream

    # --- staging -------------------------------------------------------------------------
    def rows_buffer(self, key: str, host: torch.Tensor, count: int) -> torch.Tensor:
        """The reused device buffer [count, *host.shape[1:]] that `key`'s selected rows are gathered into."""
        shape = tuple(host.shape[1:])
        return self.buffer(("rows", key, shape, host.dtype), (count, *shape), host.dtype)

    def buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The reused device buffer of `key`, viewed as `shape`; reallocated only when it must grow."""
        need = math.prod(shape)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=dtype, device=self.device)
            self._staging[key] = buf
        return buf[:need].view(shape)

    def hook_staged_embedding(self, mod: nn.Embedding, stage: Callable[[list[int]], torch.Tensor], read) -> None:
        """Hooks on an embedding whose offloaded table is staged by rows for each call: the call's distinct ids are
        read to the host once, their rows staged (`stage(rows)` -> [len(rows), dim] on the device, in that order)
        and charged by `read` (read_plan.LookupRead), and the ids renumbered onto them; the table the model held is
        put back after."""
        home, padding = mod.weight, mod.padding_idx

        @torch.compiler.disable
        def pre(m, args):
            rows, local = Selected.of(args[0])
            read.charge(self, len(rows.ids))
            weight = stage(list(rows.ids))
            self.staged_params.put(m, "weight", weight)
            # padding_idx indexes the full table (it only masks gradients): F.embedding rejects it when it is
            # beyond the staged rows, so it is lifted while the staged table is in place.
            m.padding_idx = None
            # the ids follow the staged rows: with the table kept in host memory (prefetch) the model's inputs are
            # on the host (its first parameter's device) while the rows are staged on the accelerator
            return (local.to(weight.device), *args[1:])

        @torch.compiler.disable
        def post(m, args, output):
            set_tensor(m, "weight", home)
            m.padding_idx = padding

        self.handles.append(mod.register_forward_pre_hook(pre))
        self.handles.append(mod.register_forward_hook(post))
        self.staged_embeddings.append(mod)

    def stage_rows(self, host: torch.Tensor, rows: list[int], *, key: str) -> torch.Tensor:
        """Copy host[rows] into a reused device buffer, one per `key` (a tensor's local name, so two tensors
        staged for the same forward never share one) and row shape, shared by all layers (they run in turn)."""
        out = self.rows_buffer(key, host, len(rows))
        self.copy_rows(host, rows, out)
        return out

    def copy_rows(self, host: torch.Tensor, rows: list[int], out: torch.Tensor,
                  positions: list[int] | None = None) -> None:
        """out[positions[i]] = host[rows[i]] (positions: 0, 1, ... when not given); rows and positions are host
        lists, so nothing here waits on the device.

        `host` readable by the device (the cpu, or a uva view of mapped pinned memory): one gather kernel
        that reads the host rows in place. Pinned host memory seen from an accelerator (prefetch): one
        asynchronous DMA per run of consecutive rows landing in consecutive positions, no pageable temporary."""
        if host.device == self.device:
            index = index_tensor(rows, host.device)
            if positions is None:
                torch.index_select(host, 0, index, out=out[:len(rows)])
            else:
                out.index_copy_(0, index_tensor(positions, out.device), host.index_select(0, index))
            return
        pos = range(len(rows)) if positions is None else positions
        for p, r, n in row_runs(list(pos), rows):
            out[p:p + n].copy_(host[r:r + n], non_blocking=True)


@dataclass(frozen=True)
class Selected:
    """One layer step's selected experts, ascending: on the host (`ids`, read from the device once: the step's one
    device-to-host read where staging needs them) and on the device (`index` [U] int64)."""

    ids: tuple[int, ...]
    index: torch.Tensor
    slots: tuple[int, ...] = ()   # the expert of each (token, slot) pair, row-major [T * k] (from the same read)
    k: int = 0                    # slots per token

    @classmethod
    def of(cls, top_k_index: torch.Tensor) -> tuple["Selected", torch.Tensor]:
        """(the selection, the routing renumbered 0..U-1 [T, k]) of a layer step's top_k_index [T, k]."""
        picked = cls.picked(top_k_index)
        return picked, torch.searchsorted(picked.index, top_k_index)

    @classmethod
    def picked(cls, top_k_index: torch.Tensor) -> "Selected":
        """The selection of a layer step's top_k_index [T, k] (`of` without the renumbered routing)."""
        slots = top_k_index.reshape(-1).tolist()
        ids = sorted(set(slots))
        return cls(tuple(ids), index_tensor(ids, top_k_index.device), tuple(slots), top_k_index.size(-1))

    @classmethod
    def of_ids(cls, ids: list[int], device) -> "Selected":
        """A selection from host ids, ascending."""
        return cls(tuple(ids), index_tensor(list(ids), device))


def present(index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] bool on `index`'s device: which values in [0, size) `index` holds (no read back)."""
    return torch.zeros(size, dtype=torch.bool, device=index.device).index_fill_(0, index.reshape(-1).long(), True)


def distinct(index: torch.Tensor, size: int) -> torch.Tensor:
    """How many distinct values in [0, size) `index` holds, as a 0-dim int64 tensor on its device."""
    return present(index, size).sum()


def picked_bytes(index: torch.Tensor, expert_bytes: torch.Tensor) -> torch.Tensor:
    """The bytes of the distinct experts `index` picks, each counted once (expert_bytes [E] int64 per expert), as a
    0-dim tensor on the device."""
    return (expert_bytes * present(index, expert_bytes.shape[0])).sum()


def index_tensor(values: list[int], device) -> torch.Tensor:
    """An int64 index tensor on `device` from a host list (a host-to-device copy: nothing waits on the device)."""
    return torch.tensor(values, dtype=torch.long, device=device)
