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
from dataclasses import dataclass, field
from typing import Callable

import torch

from .compute import ExpertsCompute, ExpertsMode
from ..storage.host import ExpertSplit


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
                 disk=None, dequantizer=None, experts=ExpertsMode.EAGER, host_cache=None, lookahead=None):
        self.device = device
        self.backend = backend
        self.compute = experts if isinstance(experts, ExpertsCompute) else ExpertsCompute(experts)
        self.counter = LinkCounter()
        # The disk tier (disk_tier.DiskTier) or None; its reads are counted apart from the host link's.
        self.disk = disk
        self.disk_counter = LinkCounter()
        self.routes: list[tuple[torch.Tensor, int]] = []  # uva: (top_k_index, bytes per expert), counted per call
        # Called with each forward call's routing (RoutedCall) when set; `routed` collects it during the call.
        self.recorder: Recorder | None = recorder
        self.routed: dict[int, torch.Tensor] = {}
        # The device-side expert cache (device_cache.DeviceCache), or None; it serves decode steps (`cache_step`) only.
        self.cache = cache
        self.cache_step = False
        # The host-memory cache of disk-tier experts (host_cache.HostCache), or None; decode steps only too.
        self.host_cache = host_cache
        self.host_cache_step = False
        # run/lookahead.Lookahead (predicted offloaded experts read N layers ahead), or None; decode steps only.
        self.lookahead = lookahead
        self.decode_step = False  # the call under way is a decode step (one new token per sequence, cache not empty)
        self.step_tokens = 1      # new tokens per sequence of the call under way (1: a decode step)
        # quant_weights.Dequantizer of the tensors held quantized, or None: they become the compute dtype on the
        # device right before use.
        self.dequantizer = dequantizer
        self.handles: list = []   # every hook the readers registered, removed at detach
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

    def stage_split(self, split: ExpertSplit, host: torch.Tensor, selected: torch.Tensor, on_host: torch.Tensor,
                    *, key: str, layer: int | None = None) -> torch.Tensor:
        """Gather the `selected` experts (ascending ids) of a split tensor, in that order: those of the resident
        stack by a device-local gather (no link bytes), those of the host stack `host` (`on_host`) over the link
        (or from the look-ahead's rows of `layer`)."""
        out = self.rows_buffer(key, host, selected.numel())
        rows = split.row[selected]                                   # [U] row of each expert in its stack
        here = (~on_host).nonzero().squeeze(1)                       # positions in `out` of resident experts
        there = on_host.nonzero().squeeze(1)
        out.index_copy_(0, here, split.resident.index_select(0, rows[here]))
        self.copy_expert_rows(host, rows[there], out, there, layer=layer, name=key, experts=selected[there])
        return out

    def stage_rows(self, host: torch.Tensor, rows: torch.Tensor, *, key: str, layer: int | None = None
                   ) -> torch.Tensor:
        """Copy host[rows] into a reused device buffer, one per `key` (a tensor's local name, so two tensors
        staged for the same forward never share one) and row shape, shared by all layers (they run in turn).
        `layer`: the rows are that layer's experts (row = expert id), some perhaps copied ahead by the look-ahead."""
        out = self.rows_buffer(key, host, rows.numel())
        self.copy_expert_rows(host, rows, out, None, layer=layer, name=key, experts=rows)
        return out

    def copy_expert_rows(self, host: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                         positions: torch.Tensor | None, *, layer: int | None, name: str,
                         experts: torch.Tensor | list[int]) -> None:
        """copy_rows of routed experts (`experts[i]`: the expert in host row rows[i]) of `layer`'s tensor `name`: those
        the look-ahead copied to the device for this layer step come from its rows (device-local), the rest from
        `host` (copy_rows). Same values in the same places either way."""
        la = self.lookahead if self.decode_step and layer is not None else None
        got = None
        if la is not None and la.serves(layer):
            experts = experts.tolist() if isinstance(experts, torch.Tensor) else list(experts)
            got = la.take_host(layer, name, experts)
        if got is None:
            self.copy_rows(host, rows, out, positions)
            return
        buf, slots = got
        pos = list(range(len(experts))) if positions is None else positions.tolist()
        mine = [i for i, e in enumerate(experts) if e in slots]
        rest = [i for i, e in enumerate(experts) if e not in slots]
        out.index_copy_(0, torch.tensor([pos[i] for i in mine], device=out.device),
                        buf.index_select(0, torch.tensor([slots[experts[i]] for i in mine], device=buf.device)))
        if rest:
            where = rows.device
            self.copy_rows(host, rows[torch.tensor(rest, device=where)], out,
                           positions=torch.tensor([pos[i] for i in rest], device=where))

    def copy_rows(self, host: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
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
