"""Look-ahead: while layer l computes, start reading the experts layer l + N is predicted to pick, before its router
asks.

`load(lookahead=N)` gives the runtime a `Lookahead`. After decoder layer l has run in a decode step, a
*predictor* guesses the experts of each of the next N layers (l + 1 .. l + N) not yet predicted in this step,
from l's output hidden state, and starts reading the predicted experts that are not already where the layer
will need them (N = 1: each layer predicted from the one before it; a larger N starts earlier, from a state
further away):

    disk tier   experts the device and host caches do not hold, read from the checkpoint on a worker thread
                into rows of their own (one job per expert, in the predictor's order)
    host tier   experts the device cache does not hold, copied to the device into rows of their own: on an
                accelerator on the runtime's side stream (asynchronous DMA; the layer's stream waits on an
                event), on a CPU-only machine by a second worker thread (a memcpy off the critical path)

When a predicted layer routes, its unpicked guesses are dropped (`routed`): a disk read not yet started is
cancelled, one under way stops before its next tensor. A picked expert that was predicted is taken from the
rows read ahead (`rows_ahead`: the read is done or in flight, the layer waits for that expert only);
an unpredicted one is read then, as without look-ahead. What is computed never changes, only when the bytes are
read: the tokens are bit-identical, and the caches see the very same accesses (their policies, hits and misses
are those without look-ahead; replay's figures hold). A predicted expert is never put in a cache ahead of its
use: a wrong guess can then never evict an expert that a later step needs.

Host-tier layers take the gathering path on decode steps while a look-ahead is on, uva's in-place reads included
(the eager loop sees the same rows in the same order: bit-identical, experts.py).

Where a guess is made (`source`, `load(lookahead_from=...)`): "output", layer l's output (a forward hook on the
decoder layer), or "attention", layer l's residual after its attention (a forward pre-hook on its post-attention
norm), before its MoE: a whole expert step earlier, from a state further from the router's input.

The default predictor is router_predictor.RouterPredictor. Any object with `covers(layer) -> bool` and
`predict(layer, hidden) -> expert ids, most likely first | None` can replace it; one with `predict_ids(layer,
hidden) -> ids [T, k] on the device` has its guesses read to the host on the look-ahead's worker thread, so that
the hook only queues the router and the decoder layers never wait on the device for a guess.

The layers hooked are chosen at attach, by the predictor then in place (`covers`); a predictor set later is asked
about those layers and returns None for a layer it does not handle.

Accounting (decode steps, per layer with offloaded experts): `hits` picked experts read from below the device
(host link or disk) that had been predicted and read ahead, `misses` those read on the critical path,
`wasted_bytes` bytes read ahead for guesses that were not picked, `cancelled_bytes` bytes of such guesses
dropped before they were read (wasted + cancelled is every unpicked guess's bytes: what `replay` counts as
wasted from a trace's predictions, which cannot know when a read would have been stopped). Needed bytes are
counted where they were read (host link, disk) at use, as without look-ahead. Wasted and cancelled bytes depend
on timing; hits and misses do not.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import MoeOffloadError
from ..model.inventory import layer_of, layer_prefix
from .router_predictor import RouterPredictor, ids_in_order


# Where a guess for the next layers is made (`load(lookahead_from=...)`): "output", decoder layer l's output (the
# router's input one layer later, normed: the likeliest guess, made just before layer l + 1 routes); "attention",
# layer l's residual after its attention, before its MoE (a worse guess, made a whole expert step earlier).
SOURCES = ("output", "attention")


@dataclass
class _Ahead:
    """What was started for one layer step: rows per expert and tensor, and the jobs filling them."""

    disk: dict[str, tuple[torch.Tensor, dict[int, int]]] = field(default_factory=dict)
    #     disk tier: local name -> (host rows [n, ...], expert -> its row)
    jobs: dict[int, Future] = field(default_factory=dict)       # disk: expert -> its read job (bytes read)
    stops: dict[int, threading.Event] = field(default_factory=dict)   # disk: expert -> stop before the next tensor
    host: dict[str, tuple[torch.Tensor, dict[int, int], object]] = field(default_factory=dict)
    #     host tier: local name -> (device rows [n, ...], expert -> its row, the job that fills them)
    used: set = field(default_factory=set)


@dataclass(frozen=True)
class AheadRows:
    """Rows of one tensor started ahead for a layer step: `rows` (host rows of a disk-tier tensor, device rows of a
    host-tier one), expert -> its row (`slots`), and the jobs that fill them; `wait` before reading them."""

    rows: torch.Tensor
    slots: dict[int, int]
    jobs: tuple

    def wait(self) -> None:
        for job in self.jobs:
            job.result()      # a disk read's CheckpointError is raised here


class _StreamJob:
    """Copies queued on an accelerator's side stream: waiting is making the current stream wait (no host sync).

    It holds the rows it fills (`rows`) until it is waited for: memory freed while the side stream still writes it
    could be handed to the layer's stream by the caching allocator. (A worker thread's job holds its arguments.)"""

    def __init__(self, stream, rows: torch.Tensor):
        self.device = stream.device
        self.rows = rows
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def result(self) -> None:
        """The current stream waits for the copies (before it reads the rows or their memory is handed out again)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


class Lookahead:
    """Starts reading predicted experts N layers ahead (disk: one worker thread; host: side stream or a second
    worker); counts what the guesses saved."""

    def __init__(self, distance: int, predictor=None, source: str = "output"):
        self.distance = distance
        self.predictor = predictor
        self.source = source     # the hidden state guesses are made from: SOURCES
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-lookahead")
        self._copies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-lookahead-copy")
        # The hooks' guesses are read to the host here, not on the layers' thread: a decoder layer's hook queues the
        # router on the device and hands the ids to this worker, which reads them and starts the reads and copies.
        self._guesses = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-lookahead-guess")
        self._pending: dict[int, Future] = {}   # layer -> its guess being started on the worker
        self._ahead: dict[int, _Ahead] = {}
        self._outstanding: list[tuple[object, int]] = []   # unpicked guesses' jobs and the bytes each would read
        self._layers: dict[int, object] = {}    # layer -> experts.ExpertsState with offloaded experts (host or disk)
        self.hits = 0
        self.misses = 0
        self.wasted_bytes = 0
        self.cancelled_bytes = 0
        self.predicted = 0
        self.per_layer: dict[int, list[int]] = {}    # layer -> [hits, misses]

    def attach(self, model: nn.Module, states, handles: list, rt) -> None:
        """A forward hook on every decoder layer one of whose next N layers has offloaded experts (handles kept)."""
        if self.predictor is None:
            self.predictor = RouterPredictor(model)
        self._layers = {s.layer: s for s in states.values() if s.layer is not None and (s.disk or s.offloaded)}
        for name, mod in model.named_modules():
            if layer_prefix(name) != name:
                continue
            layer = layer_of(name)
            targets = [t for t in range(layer + 1, layer + self.distance + 1)
                       if t in self._layers and self.predictor.covers(t)]
            if not targets:
                continue
            guess = self._hook(rt, targets)
            if self.source == "output":
                handles.append(mod.register_forward_hook(lambda m, args, output, g=guess: g(output)))
                continue
            norm = getattr(mod, "post_attention_layernorm", None)   # its input: the residual after attention
            if not isinstance(norm, nn.Module):
                raise MoeOffloadError(f"lookahead_from='attention' guesses from the input of a decoder layer's "
                                      f"post_attention_layernorm; {name} has none: use lookahead_from='output'")
            handles.append(norm.register_forward_pre_hook(lambda m, args, g=guess: g(args[0])))

    def serves(self, layer: int | None) -> bool:
        """Guesses were started for this layer step: its unpicked ones are dropped when it routes, its rows taken."""
        self._started(layer)
        return layer in self._ahead

    def _started(self, layer: int | None) -> None:
        """Wait until the worker has started `layer`'s guess, if one is on its way (its errors surface here)."""
        job = self._pending.pop(layer, None)
        if job is not None:
            job.result()

    def _hook(self, rt, targets: list[int]):
        def guess(output):
            if not rt.decode_step:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            for target in targets:
                if target in self._ahead or target in self._pending:   # predicted already in this step
                    continue
                # What the caches hold now, as the guess is made (the worker must not read them while they change).
                dc = rt.cache if rt.cache_step and rt.cache.serves(target) else None
                cached = dc.policy.contents() if dc is not None else set()
                held = rt.host_cache.contents() if rt.host_cache_step else set()
                early = getattr(self.predictor, "predict_ids", None)
                if early is None:            # a predictor that answers on the host (a replayed routing)
                    ids = self.predictor.predict(target, hidden)
                    if ids:
                        self._start(rt, target, ids, cached, held)
                    continue
                picked = early(target, hidden)
                if picked is not None:
                    self._pending[target] = self._guesses.submit(self._start_picked, rt, target, picked, cached,
                                                                 held)
        return guess

    def _start_picked(self, rt, layer: int, picked: torch.Tensor, cached: set, held: set) -> None:
        ids = ids_in_order(picked)           # read on this worker: the layers' thread does not wait for it
        if ids:
            self._start(rt, layer, ids, cached, held)

    def _start(self, rt, layer: int, ids: list[int], cached: set, held: set) -> None:
        state = self._layers[layer]
        below = {e for e in ids if (layer, e) not in cached}   # the device cache lacks them
        ahead = _Ahead()
        self._start_disk(state, ahead, [e for e in ids if e in below and (layer, e) not in held])
        self._start_host(rt, state, ahead, [e for e in ids if e in below])
        guessed = set(ahead.jobs).union(*(slots for _, slots, _ in ahead.host.values()))
        self.predicted += len(guessed)
        if guessed:
            self._ahead[layer] = ahead

    def _start_disk(self, state, ahead: _Ahead, want: list[int]) -> None:
        reads: dict[int, list] = {}
        for name, src in state.disk.items():
            split = state.split.get(name)
            on_disk = set(split.host_ids) if split is not None else None
            rows = [e for e in want if on_disk is None or e in on_disk]
            if rows:
                buf = torch.empty((len(rows), *src.shape[1:]), dtype=src.dtype)
                ahead.disk[name] = (buf, {e: j for j, e in enumerate(rows)})
                for j, e in enumerate(rows):
                    reads.setdefault(e, []).append((src, e, buf[j:j + 1]))
        for e in want:                 # the predictor's order: the likeliest expert is read first
            if e in reads:
                ahead.stops[e] = stop = threading.Event()
                ahead.jobs[e] = self._pool.submit(_read_all, reads[e], stop)

    def _start_host(self, rt, state, ahead: _Ahead, want: list[int]) -> None:
        for name, host in state.offloaded.items():
            split = state.split.get(name)
            rows = {e: (split.host_ids.index(e) if split is not None else e) for e in want
                    if split is None or e in split.host_ids}
            if not rows:
                continue
            buf = torch.empty((len(rows), *host.shape[1:]), dtype=host.dtype, device=rt.device)
            index = list(rows.values())
            if rt.stream is not None:
                # The side stream starts after what the layer's stream queued (buf's allocation); the layer's stream
                # waits on the event before it reads buf, and before buf's memory is handed out again (settle).
                rt.stream.wait_stream(torch.cuda.current_stream(rt.device))
                with torch.cuda.stream(rt.stream):
                    rt.copy_rows(host, index, buf)
                job = _StreamJob(rt.stream, buf)
            else:
                job = self._copies.submit(rt.copy_rows, host, index, buf)
            ahead.host[name] = (buf, {e: j for j, e in enumerate(rows)}, job)

    def routed(self, layer: int, picked: list[int]) -> None:
        """Layer `layer` has routed: its guesses that were not picked are dropped (a read not started is cancelled,
        one under way stops before its next tensor)."""
        self._started(layer)
        ahead = self._ahead.get(layer)
        if ahead is None:
            return
        keep = set(picked)
        for e, job in ahead.jobs.items():
            if e not in keep:
                ahead.stops[e].set()
                job.cancel()

    def rows_ahead(self, layer: int, name: str, experts: list[int]) -> AheadRows | None:
        """The rows of tensor `name` started ahead for this layer step, for those of `experts` among them, or None when
        none was (read them now). Nothing waits here: the reader waits (`AheadRows.wait`) for these experts' jobs
        only, right before it copies them. They count as used (look-ahead hits)."""
        self._started(layer)
        ahead = self._ahead.get(layer)
        if ahead is None:
            return None
        if name in ahead.host:
            buf, slots, job = ahead.host[name]
            jobs = lambda mine: (job,)
        elif name in ahead.disk:
            buf, slots = ahead.disk[name]
            jobs = lambda mine: tuple(ahead.jobs[e] for e in mine)
        else:
            return None
        mine = {e: slots[e] for e in experts if e in slots}
        if not mine:
            return None
        ahead.used.update(mine)
        return AheadRows(buf, mine, jobs(mine))

    def end_layer(self, layer: int, needed: list[int]) -> None:
        """Layer step `layer` read `needed` from below the device (host link or disk; not from the device cache,
        the host cache or a resident stack): count the hits, hand its unpicked guesses to `settle`."""
        self._started(layer)
        ahead = self._ahead.pop(layer, None)
        counts = self.per_layer.setdefault(layer, [0, 0])
        used = ahead.used if ahead is not None else set()
        hit = sum(1 for e in needed if e in used)
        counts[0] += hit
        counts[1] += len(needed) - hit
        self.hits += hit
        self.misses += len(needed) - hit
        if ahead is not None:
            self._outstanding.extend(_unpicked(ahead))

    def settle(self) -> None:
        """A forward call ends (or the next begins): the reads still under way are waited for (a read error
        surfaces here, at the latest) and dropped: no read outlives the call that started it."""
        for layer in list(self._pending):
            self._started(layer)
        pending = self._outstanding + [p for ahead in self._ahead.values() for p in _unpicked(ahead, every=True)]
        self._outstanding, self._ahead = [], {}
        first = None
        for job, nbytes in pending:
            got = _outcome(job)
            if isinstance(got, BaseException):
                first = first or got
                continue
            done = nbytes if got is None else got      # a host copy: all of it
            self.wasted_bytes += done
            self.cancelled_bytes += nbytes - done
        if first is not None:
            raise first

    def reset(self) -> None:
        for job in self._pending.values():
            _outcome(job)
        self._pending.clear()
        for job, _ in self._outstanding:
            _outcome(job)
        self._outstanding.clear()
        self._ahead.clear()
        self.hits = self.misses = self.wasted_bytes = self.cancelled_bytes = self.predicted = 0
        self.per_layer.clear()

    def close(self) -> None:
        self._guesses.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._copies.shutdown(wait=True)

    def stats(self, decode_tokens: int) -> dict:
        recall = {str(layer): h / (h + m) if h + m else None for layer, (h, m) in sorted(self.per_layer.items())}
        per = (lambda b: b / decode_tokens) if decode_tokens else (lambda b: 0.0)
        return {"lookahead": self.distance, "lookahead_from": self.source, "lookahead_hits": self.hits,
                "lookahead_misses": self.misses,
                "lookahead_wasted_bytes_per_token": per(self.wasted_bytes),
                "lookahead_cancelled_bytes_per_token": per(self.cancelled_bytes),
                "lookahead_recall": recall}


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _unpicked(ahead: _Ahead, every: bool = False) -> list[tuple[object, int]]:
    """The jobs of guesses this layer step did not use, each with the bytes it would read (`every`: the layer never
    routed, so every job is unused)."""
    used = set() if every else ahead.used
    out = [(job, sum(_row_bytes(buf) for buf, slots in ahead.disk.values() if e in slots))
           for e, job in ahead.jobs.items() if e not in used]
    out += [(job, _row_bytes(buf) * sum(1 for e in slots if e not in used)) for buf, slots, job in ahead.host.values()]
    return out


def _outcome(job):
    """Waits for a job: its bytes read (a disk read; 0 if cancelled before it started), None (a host copy: done), or
    the exception it raised."""
    try:
        return job.result()
    except CancelledError:
        return 0
    except Exception as exc:        # a read's CheckpointError, raised by settle
        return exc


def _read_all(reads, stop: threading.Event) -> int:
    """One predicted expert's rows, tensor by tensor, until told to stop; the bytes read."""
    done = 0
    for src, expert, buf in reads:
        if stop.is_set():
            break
        src.read_rows([expert], buf)
        done += buf.numel() * buf.element_size()
    return done


def lookahead_stats(la: Lookahead | None, decode_tokens: int) -> dict:
    if la is None:
        return {"lookahead": 0, "lookahead_from": None, "lookahead_hits": 0, "lookahead_misses": 0,
                "lookahead_wasted_bytes_per_token": 0.0,
                "lookahead_cancelled_bytes_per_token": 0.0, "lookahead_recall": {}}
    return la.stats(decode_tokens)
