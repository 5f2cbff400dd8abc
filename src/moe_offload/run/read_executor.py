"""The executor of a layer step's read plan (read_plan.py): every copy the plan names, grouped by source, runs of
consecutive rows as one copy. It decides nothing and charges nothing.

For each offloaded tensor of the step, into the runtime's reused buffer [U, ...] (the selected experts in ascending
order, so the eager loop's arithmetic is the model's own whatever lies where):

    RESIDENT      one device-local gather from the split tensor's resident stack
    DEVICE_PAGE   one device-local gather of the device cache's pages
    HOST_ROW      state.RunState.copy_rows: one gather of the host rows in place (a cpu or uva host stack), or one
                  asynchronous copy per run of consecutive rows landing in consecutive positions (pinned memory)
    AHEAD         waits for these experts' look-ahead jobs only, then one gather of their rows
    disk tier     HOST_PAGE, AHEAD and DISK rows land in host memory first (the buffer itself on a CPU-only machine,
                  else the disk tier's pinned staging): checkpoint reads (disk_tier.DiskTier.read_into: a run of
                  consecutive positions as one read, else several in flight), host-cache pages by runs (one memcpy
                  each); admitted experts' rows then go into the host cache's pages, and the landed rows to the
                  device, one copy per run
    admissions    last, once every row has landed: admitted experts' rows into the device cache's pages
    HOST_COMPUTE  nothing: the host's kernels read the host row in place (host_compute.py); a disk-tier row of an
                  expert computed on the host lands in host memory and stays there (`landed`)

Given a `Deferred` (streamed.py: a CPU-only decode step), the checkpoint reads are not waited for here: each
expert's read, and its host-cache admission after it, is queued on it in the order of the rows, so the caller
computes each expert as soon as its rows have landed while the next ones are read; a host-cache hit whose pages
are one run, and a resident row of a split tensor, are not copied at all (their views are `placed` there, for the
kernels to read in place), and a miss the host cache admits into one run of pages is read straight into them (and
placed there too): no copy of it but the read's own.

A page copy views a row as uint8 pages of the cache's page size (every cached row is a whole number of them).
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..storage.host import byte_view, row_runs
from .read_plan import Source, StepPlan, TensorReads
from .state import index_tensor

ExpertsLike = object   # experts.ExpertsState (not imported: it imports this module)

if TYPE_CHECKING:
    from .state import RunState


def execute(rt: "RunState", state: ExpertsLike, plan: StepPlan) -> dict[str, torch.Tensor]:
    """The plan's copies: local name -> the gathered [U, ...] stack of each offloaded tensor of the step."""
    return execute_sides(rt, state, plan)[0]


def execute_sides(rt: "RunState", state: ExpertsLike, plan: StepPlan, skip_resident=frozenset(),
                  deferred: "Deferred | None" = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the gathered stacks, the host rows landed per disk-tier tensor: [U, ...] in host memory, position i the
    i-th selected expert's row where it was read from below the device). `skip_resident`: tensors whose resident
    rows are not gathered (the device's kernels read that stack in place). `deferred`: the checkpoint reads of rows
    landing in the gathered stack itself (a cpu device) are queued there, not waited for."""
    count, landed = len(plan.selected.ids), {}
    on_host = set(plan.on_host)
    staged = {t.name: _tensor(rt, state, t, count, t.name in skip_resident, on_host, landed, deferred)
              for t in plan.tensors
              if not all(r.source is Source.HOST_COMPUTE or (r.source is Source.RESIDENT and t.name in skip_resident)
                         for r in t.reads)}    # a tensor with nothing to copy has no gathered stack
    return staged, landed


def _tensor(rt: "RunState", state: ExpertsLike, t: TensorReads, count: int, skip_resident: bool, on_host: set,
            landed: dict, deferred: "Deferred | None" = None) -> torch.Tensor:
    if t.on_disk:
        src = state.disk[t.name]
        out = rt.buffer(("rows", t.name, src.shape[1:], src.dtype), (count, *src.shape[1:]), src.dtype)
    else:
        host = state.offloaded[t.name]
        out = rt.rows_buffer(t.name, host, count)
    dev = out.device
    resident = t.of(Source.RESIDENT)
    if resident and not skip_resident:
        stack = state.split[t.name].resident
        if deferred is not None and dev.type == "cpu":     # a streamed step's kernels read them where they lie
            for r in resident:
                deferred.place(r.position, t.name, stack, r.row)
        else:
            byte_view(out).index_copy_(0, index_tensor([r.position for r in resident], dev),    # float8 as bytes
                                       byte_view(stack).index_select(0, index_tensor([r.row for r in resident], dev)))
    cached = t.of(Source.DEVICE_PAGE)
    if cached:
        _pages_in(rt.cache.arena, out, cached)
    if t.on_disk:
        _disk_rows(rt, state, t, out, on_host, landed, deferred)
    else:
        linked = t.of(Source.HOST_ROW)
        if linked:
            rt.copy_rows(host, [r.row for r in linked], out, [r.position for r in linked])
        ahead = t.of(Source.AHEAD)
        if ahead:
            t.ahead.wait()
            out.index_copy_(0, index_tensor([r.position for r in ahead], dev),
                            t.ahead.rows.index_select(0, index_tensor([r.row for r in ahead], t.ahead.rows.device)))
    if t.admit_device:   # after every row landed in `out` (same stream): out -> the pages the policy claimed
        arena = rt.cache.arena
        rows = out.view(-1).view(torch.uint8).view(-1, arena.shape[1])
        per = rows.shape[0] // count
        arena.index_copy_(0, index_tensor([p for _, pages in t.admit_device for p in pages], dev),
                          rows.index_select(0, index_tensor([i * per + j for i, pages in t.admit_device
                                                             for j in range(len(pages))], dev)))
    return out


def _pages_in(arena: torch.Tensor, out: torch.Tensor, reads: list) -> None:
    """out's rows of `reads` <- their pages in the device cache's arena (device-local)."""
    rows = out.view(-1).view(torch.uint8).view(-1, arena.shape[1])
    per = rows.shape[0] // out.shape[0]
    dev = out.device
    rows.index_copy_(0, index_tensor([r.position * per + j for r in reads for j in range(len(r.pages))], dev),
                     arena.index_select(0, index_tensor([p for r in reads for p in r.pages], dev)))


def _disk_rows(rt: "RunState", state: ExpertsLike, t: TensorReads, out: torch.Tensor, on_host: set,
               landed: dict, deferred: "Deferred | None" = None) -> None:
    """A disk-tier tensor's rows from below the device: landed in host memory, then on the device (but those of
    experts computed on the host)."""
    below = t.of(Source.HOST_PAGE, Source.AHEAD, Source.DISK)
    if not below:
        return
    src = state.disk[t.name]
    land = out if out.device.type == "cpu" else rt.disk.staging(t.name, src)
    disk, hits, admit = t.of(Source.DISK), t.of(Source.HOST_PAGE), t.admit_host
    if deferred is not None and land is out:    # queued in the order of the rows; a worker lands each (a read then,
        pages = dict(admit)                     # where admitted, its store in the host cache) while the caller waits
        queued = {r.position for r in disk}
        cache = rt.host_cache
        arena = cache.stack_view(out.shape[1:], out.dtype) if cache is not None and (hits or admit) else None
        for r in disk:                          # admitted into one run of pages: read straight into them
            start = cache.run_start(list(pages[r.position])) if pages.get(r.position) else None
            if start is not None:
                deferred.place(r.position, t.name, arena, start)
                deferred.read(r.position, partial(src.read_rows, [r.row], arena[start].unsqueeze(0)))
            else:
                deferred.read(r.position, partial(_land, rt, src, r.row, out, r.position, pages.get(r.position)))
        for r in hits:                          # a row in one run of pages is read in place by the kernels
            start = cache.run_start(list(r.pages))
            if start is not None:
                deferred.place(r.position, t.name, arena, start)
            else:
                deferred.read(r.position, partial(cache.read, list(r.pages), out[r.position]))
        admit = [a for a in admit if a[0] not in queued]      # the look-ahead's rows: stored below
        disk, hits = [], []
    if disk:
        rt.disk.read_into(src, [r.row for r in disk], land, [r.position for r in disk])
    for r in hits:
        rt.host_cache.read(list(r.pages), land[r.position])
    ahead = t.of(Source.AHEAD)
    if ahead:
        t.ahead.wait()
        byte_view(land).index_copy_(0, index_tensor([r.position for r in ahead], land.device),   # float8 as bytes
                                    byte_view(t.ahead.rows).index_select(0, index_tensor([r.row for r in ahead],
                                                                                         land.device)))
    for position, pages in admit:           # admitted by the host cache's policy: into the pages it claimed
        rt.host_cache.store(list(pages), land[position])
    landed[t.name] = land
    if land is not out:                     # synchronous: the staging is reused by the next read
        positions = sorted(r.position for r in below if r.expert not in on_host)
        for p, _, n in row_runs(positions, positions):
            out[p:p + n].copy_(land[p:p + n])


def _land(rt: "RunState", src, expert: int, out: torch.Tensor, position: int, pages) -> None:
    """A streamed step's worker: one expert's row read from the checkpoint into out[position], then stored in the
    host cache's pages where its policy admitted it."""
    src.read_rows([expert], out[position:position + 1])
    if pages:
        rt.host_cache.store(list(pages), out[position])


class Deferred:
    """The row copies of a layer step not waited for by the executor (checkpoint reads, each followed by its host-cache
    admission; host-cache pages): queued per row position (`read`); `start(submit)` issues them in position order on
    the disk tier's threads, `wait(positions)` returns once those rows have landed (a read's error raised there),
    `landed(positions)` says which have without waiting, `finish()` waits for every job still running (the buffers
    are reused by the next step). `placed`: (position, tensor) -> (stack, row): a row not copied into the gathered
    stack, read where it lies (a resident row of a split tensor; a host-cache row in one run of pages, a hit or a miss
    read straight into them) as stack[row]."""

    def __init__(self):
        self._queued: dict[int, list[Callable]] = {}
        self._running: dict[int, list[Future]] = {}
        self.placed: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}

    def place(self, position: int, name: str, stack: torch.Tensor, row: int) -> None:
        self.placed[(position, name)] = (stack, row)

    @property
    def pending(self) -> set[int]:
        """The positions with jobs queued or not yet waited for."""
        return set(self._queued) | set(self._running)

    def read(self, position: int, job: Callable) -> None:
        self._queued.setdefault(position, []).append(job)

    def start(self, submit: Callable[[Callable], Future]) -> None:
        for position in sorted(self._queued):
            self._running[position] = [submit(job) for job in self._queued[position]]
        self._queued.clear()

    def wait(self, positions: Iterable[int]) -> None:
        for p in positions:
            for job in self._running.pop(p, ()):
                job.result()

    def landed(self, positions: Iterable[int]) -> list[int]:
        """Those of `positions` whose jobs have all finished (not waiting for any): `wait` for them still raises
        a read's error."""
        return [p for p in positions if p not in self._queued and all(j.done() for j in self._running.get(p, ()))]

    def finish(self) -> None:
        """Every job still running waited for, its error dropped (the caller is raising one already)."""
        for jobs in self._running.values():
            for job in jobs:
                try:
                    job.result()
                except Exception:
                    pass
        self._running.clear()
