"""The read plan: for one layer step, where each selected expert of each offloaded tensor comes from and which counter
its bytes are charged to; and the plans of the other offloaded reads (a dense module's tensors, an embedding's rows,
uva's in-place expert reads). This module is the only place that charges a counter.

A layer step that gathers its selected experts (experts.py: prefetch, a split tensor, a cache, a look-ahead, the disk
tier, quantized experts to dequantize) is planned here, then carried out by one executor (read_executor.py):

    plan_step     the decisions, in replay's order: the look-ahead drops its unpicked guesses, the device cache's
                  policy decides each selected expert (pages.PagedCache.decide: hits, admissions, victims), the host
                  cache's policy decides the disk-tier experts the device cache does not hold; then, per tensor and
                  expert, one `Read` with its `Source`:

        RESIDENT     the split tensor's resident stack, on the device          no counter
        DEVICE_PAGE  the device cache's pages                                  no counter (a hit)
        HOST_ROW     the host stack, over the link                             link
        AHEAD        the rows the look-ahead started for this step             link (host tier) or disk (disk tier)
        HOST_PAGE    the host cache's pages (a disk-tier expert)               link (from host memory)
        DISK         the checkpoint                                            disk
        HOST_COMPUTE the host stack, read in place by the host's kernels       none (the expert is computed on the
                                                                               host: only activations cross)

                  and the admissions: rows to copy into the device cache's or the host cache's claimed pages once
                  they have landed. With host compute (host_compute.py) the experts that lie wholly off the device
                  and that the device cache neither holds nor admits may be computed on the host, as the cost model
                  chooses for the step (`HostSide`): a host-tier row is then read in place by the host's kernels
                  (HOST_COMPUTE), a disk-tier row lands in host memory and stays there (HOST_PAGE, AHEAD, DISK with
                  no link), and the step's activations are charged to the link instead.
    charge        the counters, once per layer step, from the plan: accounting.TokenBytes.step_bytes of the selected
                  experts with the plan's device-cache hits and host-cache hits, the definition replay sums over a
                  trace; so the runtime's counts equal replay's by construction, whichever rows the bytes come from.

The other reads charge through their plans here too: `WholeRead` (a module's offloaded dense tensors, read in full
every call), `LookupRead` (an embedding's distinct rows), `InPlaceRead` (uva's experts indexed in place, charged on
the device at the end of the call: nothing waits on the device for its own accounting).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ..planning.placement import Tier
from .lookahead import AheadRows
from .pages import Decision
from .state import Selected, picked_bytes

ExpertsLike = object   # experts.ExpertsState (not imported: it imports this module)

if TYPE_CHECKING:
    from .state import LinkCounter, RunState


class Source(Enum):
    """Where one selected expert's row of one tensor comes from in a layer step."""

    RESIDENT = "resident"
    DEVICE_PAGE = "device-cache page"
    HOST_ROW = "host row"
    AHEAD = "look-ahead row"
    HOST_PAGE = "host-cache page"
    DISK = "disk"
    HOST_COMPUTE = "computed on the host"


class Counter(Enum):
    """The runtime's byte counters: the host link's, the disk tier's, and of the host link's bytes those that were
    activations (host compute: hidden states to the host, pair outputs back; the rest were weights)."""

    LINK = "link"
    DISK = "disk"
    ACTIVATION = "activation"

    def of(self, rt: "RunState") -> "LinkCounter":
        return {Counter.LINK: rt.counter, Counter.DISK: rt.disk_counter,
                Counter.ACTIVATION: rt.activation_counter}[self]


@dataclass(frozen=True)
class Read:
    """One selected expert's row of one tensor: its place in the gathered stack, its source and the counter its
    bytes go to (None: a device-local read)."""

    position: int                  # its row in the gathered [U, ...] stack (the selection's ascending order)
    expert: int
    source: Source
    row: int = -1                  # RESIDENT / HOST_ROW: its row in that stack; AHEAD: its look-ahead slot; DISK: id
    pages: tuple[int, ...] = ()    # DEVICE_PAGE / HOST_PAGE: its pages in that cache's arena
    counter: Counter | None = None


@dataclass(frozen=True)
class TensorReads:
    """One offloaded tensor's reads in a layer step, and the rows to copy into claimed cache pages after."""

    name: str                      # local name in the experts module
    on_disk: bool                  # a disk-tier tensor (its below-device rows land in host memory first)
    reads: tuple[Read, ...]
    ahead: AheadRows | None = None                        # the look-ahead's rows the AHEAD reads take
    admit_device: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (position, its device-cache pages)
    admit_host: tuple[tuple[int, tuple[int, ...]], ...] = ()     # (position, its host-cache pages)

    def of(self, *sources: Source) -> list[Read]:
        return [r for r in self.reads if r.source in sources]


@dataclass(frozen=True)
class HostSide:
    """The experts of a layer step computed on the host, and what crosses the link for them."""

    experts: tuple[int, ...]        # ascending
    pairs: tuple[int, ...]          # their (token, slot) pairs: positions in the step's slots, ascending
    tokens: tuple[int, ...]         # the tokens with such a pair: their hidden states go to the host
    activation_bytes: int           # those hidden states in, one output per pair back


@dataclass(frozen=True)
class StepPlan:
    """Every read of one layer step, decided before anything is copied."""

    layer: int
    selected: Selected
    tensors: tuple[TensorReads, ...]
    device_hits: tuple[int, ...]   # experts served from the device cache's pages
    host_hits: tuple[int, ...]     # disk-tier experts served from the host cache's pages
    host: HostSide | None = None   # the experts computed on the host (None: every expert on the device)

    @property
    def on_host(self) -> tuple[int, ...]:
        return self.host.experts if self.host is not None else ()

    def below(self) -> list[int]:
        """The experts read from below the device (host link or disk; not a cache or a resident stack), ascending:
        what the look-ahead counts its hits against."""
        return sorted({r.expert for t in self.tensors for r in t.of(Source.HOST_ROW, Source.AHEAD, Source.DISK)})

    def charge(self, rt: "RunState") -> None:
        """Charge the step's bytes, once (TokenBytes.step_bytes: every selected expert's offloaded bytes from its
        tier, nothing for a device-cache hit, a host-cache hit's disk bytes from host memory, no weight bytes over
        the link for an expert computed on the host; its activations instead)."""
        host, disk = rt.token_bytes.step_bytes(self.layer, self.selected.ids, self.device_hits, self.host_hits,
                                               self.on_host)
        activations = self.host.activation_bytes if self.host is not None else 0
        Counter.LINK.of(rt).add(host + activations)       # what crosses the host link: weights and activations
        Counter.DISK.of(rt).add(disk)
        if activations:
            Counter.ACTIVATION.of(rt).add(activations)    # of which activations (the JSON's split)


def plan_step(rt: "RunState", state: ExpertsLike, selected: Selected, through_cache: bool,
              host=None, keeps: frozenset | None = None) -> StepPlan:
    """The read plan of `state`'s layer step for its `selected` experts. `through_cache`: a decode step the device
    cache serves (every offloaded expert tensor is then read through it). `host`: with host compute, a callable
    given the experts that could be computed on the host (ascending) that returns their HostSide, or None to
    compute them on the device (host_compute.HostCompute.side: the cost model's choice). Runs the caches' policies
    (their decisions are the step's), nothing else: no copy, no counter. A prefill step's disk experts that the
    host cache keeps (host_cache.HostCache.prefill_keeps: of `selected`'s pairs, or `keeps` given for a chunk of a
    step) are read from disk and admitted into its free pages, nothing hit."""
    layer, ids = state.layer, list(selected.ids)
    la = rt.lookahead if rt.lookahead is not None and rt.decode_step else None
    if la is not None and la.serves(layer):                      # the guesses not picked are dropped first
        la.routed(layer, ids)
    else:
        la = None
    dc = rt.cache.decide(layer, ids) if through_cache else None
    off_device = [e for e in ids if dc is None or not dc.held(e)]
    hc = rt.host_cache if state.disk and rt.host_cache is not None and rt.host_cache.serves(layer) else None
    if hc is not None and rt.host_cache_step:
        hd = hc.decide(layer, off_device)
    elif hc is not None and not rt.decode_step:
        kept = keeps if keeps is not None else hc.prefill_keeps(layer, selected.slots)
        hd = hc.preload(layer, [e for e in ids if e in kept])
    else:
        hd = None
    side = host(_host_candidates(state, off_device, dc)) if host is not None else None
    local = set(side.experts) if side is not None else set()
    tensors = [_tensor_reads(state, name, False, ids, dc, None, la, local) for name in state.offloaded]
    tensors += [_tensor_reads(state, name, True, ids, dc, hd, la, local) for name in state.disk]
    return StepPlan(layer, selected, tuple(tensors),
                    tuple(e for e in ids if dc is not None and dc.held(e)),
                    tuple(e for e in off_device if hd is not None and hd.held(e)), side)


def prefill_kept(rt: "RunState", state: ExpertsLike, selected: Selected) -> frozenset:
    """The experts of a prefill layer step (every pair in `selected.slots`) that the host cache keeps; none where it
    does not serve the layer or in a decode step."""
    hc = rt.host_cache
    if not state.disk or hc is None or not hc.serves(state.layer) or rt.decode_step:
        return frozenset()
    return hc.prefill_keeps(state.layer, selected.slots)


def _host_candidates(state: ExpertsLike, off_device: list[int], dc: Decision | None) -> list[int]:
    """The experts that may be computed on the host: every offloaded tensor holds them off the device, and the
    device cache does not admit them (an admitted expert travels to fill its pages: the device computes it)."""
    names = [*state.offloaded, *state.disk]
    return [e for e in off_device if not (dc is not None and dc.admitted(e))
            and all(state.split[n].where(e)[0] == Tier.HOST for n in names if n in state.split)]


def _tensor_reads(state: ExpertsLike, name: str, on_disk: bool, ids: list[int], dc: Decision | None,
                  hd: Decision | None, la, local: set) -> TensorReads:
    split = state.split.get(name)
    places = [split.where(e) if split is not None else (Tier.HOST, e) for e in ids]   # HOST: off the device
    held = lambda d, e: d is not None and d.held(e)
    wanted = [e for e, (tier, _) in zip(ids, places) if tier == Tier.HOST and not held(dc, e)
              and not (on_disk and held(hd, e)) and not (e in local and not on_disk)]
    ahead = la.rows_ahead(state.layer, name, wanted) if la is not None and wanted else None
    tier_counter = Counter.DISK if on_disk else Counter.LINK
    reads, admit_device, admit_host = [], [], []
    for i, (e, (tier, row)) in enumerate(zip(ids, places)):
        if tier != Tier.HOST:
            reads.append(Read(i, e, Source.RESIDENT, row))
            continue
        if held(dc, e):
            reads.append(Read(i, e, Source.DEVICE_PAGE, pages=tuple(dc.pages_of(e, name))))
            continue
        if e in local and not on_disk:     # computed on the host, from its host row in place
            reads.append(Read(i, e, Source.HOST_COMPUTE, row))
        elif on_disk and held(hd, e):
            reads.append(Read(i, e, Source.HOST_PAGE, pages=tuple(hd.pages_of(e, name)),
                              counter=None if e in local else Counter.LINK))
        elif ahead is not None and e in ahead.slots:
            reads.append(Read(i, e, Source.AHEAD, ahead.slots[e], counter=tier_counter))
        elif on_disk:
            reads.append(Read(i, e, Source.DISK, e, counter=Counter.DISK))
        else:
            reads.append(Read(i, e, Source.HOST_ROW, row, counter=Counter.LINK))
        if dc is not None and dc.admitted(e):
            admit_device.append((i, tuple(dc.pages_of(e, name))))
        if on_disk and hd is not None and hd.admitted(e):
            admit_host.append((i, tuple(hd.pages_of(e, name))))
    return TensorReads(name, on_disk, tuple(reads), ahead, tuple(admit_device), tuple(admit_host))


# --- the other reads' plans -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WholeRead:
    """A module's offloaded dense tensors, read in full every call it makes."""

    counter: Counter
    nbytes: int

    def charge(self, rt: "RunState") -> None:
        self.counter.of(rt).add(self.nbytes)


@dataclass(frozen=True)
class LookupRead:
    """An embedding lookup of an offloaded table: the call's distinct rows (a host count, or a device count of the
    uva path, read back with the counts)."""

    counter: Counter
    row_bytes: int

    def charge(self, rt: "RunState", rows: "int | torch.Tensor") -> None:
        self.counter.of(rt).add(rows * self.row_bytes)


@dataclass(frozen=True)
class InPlaceRead:
    """uva's experts indexed in place in whole host tensors: the distinct experts of `top_k_index`, each expert's host
    bytes once (the plan's accounting, as a device tensor per layer), counted on the device at the end of the call."""

    layer: int
    top_k_index: torch.Tensor

    def charge(self, rt: "RunState") -> None:
        Counter.LINK.of(rt).add(picked_bytes(self.top_k_index, rt.host_expert_bytes(self.layer)))
