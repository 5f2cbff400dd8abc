"""Look-ahead: while layer l computes, read the experts layer l + N is predicted to pick, before its router asks.

`load(lookahead=N)` gives the runtime a `Lookahead`. After decoder layer l has run in a decode step, a
*predictor* guesses the experts of each of the next N layers (l + 1 .. l + N) not yet predicted in this step,
from l's output hidden state, and the disk-tier experts among them that the host cache does not hold are read
from the checkpoint on a worker thread (N = 1: each layer predicted from the one before it; a larger N starts
earlier, from a state further away). When a predicted layer routes, a predicted expert is taken from those rows (the read is already done or in flight); an unpredicted
one is read then, as without look-ahead. What is computed never changes, only when the bytes are read: the
tokens are bit-identical, and the host cache sees the very same accesses (its policy, hits and misses are
those without look-ahead; replay's figures hold).

`RouterPredictor`, the default and the one that needs no training (Mixtral-offloading's): layer l + N's own
router applied to layer l's output after layer l + N's post-attention norm (the router's input is that norm of
a residual stream one layer later). Any object with `covers(layer) -> bool` and `predict(layer, hidden) ->
expert ids, most likely first | None` can replace it.

Each predicted expert is one read job on the worker thread, in the predictor's order: a layer that routes waits
only for the jobs of the experts it picked (`take`), never for a wrong guess's; wrong guesses are read all the
same (deterministic counts: every predicted disk expert the host cache lacks is read once), in the background,
and waited for when the forward call ends.

The layers hooked are chosen at attach, by the predictor then in place (`covers`); a predictor set later is asked
about those layers and returns None for a layer it does not handle.

Accounting (decode steps, per layer with disk-tier experts): `hits` picked experts that had been predicted and
read ahead, `misses` picked disk experts read on the critical path, `wasted_bytes` predicted rows read and then
not picked. Needed bytes are counted where they were read (disk) at use, as without look-ahead.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..model.inventory import layer_of, layer_prefix


class RouterPredictor:
    """Layer t's experts predicted by layer t's router on an earlier layer's output hidden state."""

    def __init__(self, model: nn.Module):
        self._layers: dict[int, tuple[nn.Module, nn.Module]] = {}   # layer -> (post-attention norm, router)
        for name, mod in model.named_modules():
            if layer_prefix(name) != name:   # decoder layers only
                continue
            layer = layer_of(name)
            mlp = getattr(mod, "mlp", None)
            norm = getattr(mod, "post_attention_layernorm", None)
            router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
            if isinstance(norm, nn.Module) and isinstance(router, nn.Module) and _readable(norm, router):
                self._layers[layer] = (norm, router)

    def covers(self, layer: int) -> bool:
        return layer in self._layers

    @torch.no_grad()
    def predict(self, layer: int, hidden: torch.Tensor) -> list[int] | None:
        if layer not in self._layers:
            return None
        norm, router = self._layers[layer]
        out = router(norm(hidden).reshape(-1, hidden.shape[-1]))
        ids = next((t for t in (out if isinstance(out, tuple) else (out,))[::-1]
                    if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
        # the router's top-k order, most likely first (a look-ahead reads them in this order), each id once
        return None if ids is None else list(dict.fromkeys(ids.reshape(-1).tolist()))


def _readable(*mods: nn.Module) -> bool:
    # A router or norm whose weights are on the disk tier is a meta placeholder until its layer's hook reads it.
    return all(p.device.type != "meta" for m in mods for p in m.parameters())


@dataclass
class _Ahead:
    """Rows read ahead for one layer: expert -> local tensor name -> row, and each expert's read job."""

    rows: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    jobs: dict[int, Future] = field(default_factory=dict)
    used: set = field(default_factory=set)


class Lookahead:
    """Reads predicted disk-tier experts N layers ahead on one worker thread; counts what the guesses saved."""

    def __init__(self, distance: int, predictor=None):
        self.distance = distance
        self.predictor = predictor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-offload-lookahead")
        self._ahead: dict[int, _Ahead] = {}
        self._outstanding: list[Future] = []         # wrong guesses' reads, finishing in the background
        self._disk_layers: dict[int, object] = {}   # layer -> experts.ExpertsState with disk tensors
        self.hits = 0
        self.misses = 0
        self.wasted_bytes = 0
        self.predicted = 0
        self.per_layer: dict[int, list[int]] = {}    # layer -> [hits, misses]

    def attach(self, model: nn.Module, states, handles: list, rt) -> None:
        """A forward hook on every decoder layer one of whose next N layers has disk-tier experts (handles kept)."""
        if self.predictor is None:
            self.predictor = RouterPredictor(model)
        self._disk_layers = {s.layer: s for s in states.values() if s.layer is not None and s.disk}
        for name, mod in model.named_modules():
            if layer_prefix(name) != name:
                continue
            layer = layer_of(name)
            targets = [t for t in range(layer + 1, layer + self.distance + 1)
                       if t in self._disk_layers and self.predictor.covers(t)]
            if targets:
                handles.append(mod.register_forward_hook(self._hook(rt, targets)))

    def _hook(self, rt, targets: list[int]):
        def post(module, args, output):
            if not rt.decode_step:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            for target in targets:
                if target in self._ahead:     # predicted already in this step, from an earlier layer
                    continue
                ids = self.predictor.predict(target, hidden)
                if ids:
                    self._start(rt, target, ids)
        return post

    def _start(self, rt, layer: int, ids: list[int]) -> None:
        state = self._disk_layers[layer]
        hc = rt.host_cache if rt.host_cache_step else None
        held = hc.contents() if hc is not None else set()
        want = [e for e in ids if (layer, e) not in held]
        ahead = _Ahead()
        self.predicted += len(want)
        reads: dict[int, list] = {}
        for name, src in state.disk.items():
            split = state.split.get(name)
            on_disk = set(split.host_ids) if split is not None else None
            rows = [e for e in want if on_disk is None or e in on_disk]
            if rows:
                buf = torch.empty((len(rows), *src.shape[1:]), dtype=src.dtype)
                for j, e in enumerate(rows):
                    ahead.rows.setdefault(e, {})[name] = buf[j]
                    reads.setdefault(e, []).append((src, e, buf[j:j + 1]))
        for e in want:                 # the predictor's order: the likeliest expert is read first
            if e in reads:
                ahead.jobs[e] = self._pool.submit(_read_all, reads[e])
        if ahead.jobs:
            self._ahead[layer] = ahead

    def take(self, layer: int, name: str, expert: int) -> torch.Tensor | None:
        """The row of `expert` in tensor `name` read ahead for this layer step, or None (read it now)."""
        ahead = self._ahead.get(layer)
        if ahead is None or expert not in ahead.rows or name not in ahead.rows[expert]:
            return None
        ahead.jobs[expert].result()      # this expert's read only; its CheckpointError is raised here
        ahead.used.add(expert)
        return ahead.rows[expert][name]

    def end_layer(self, layer: int, needed: list[int]) -> None:
        """After layer step `layer` read its disk experts `needed` (not in the host cache): count and drop."""
        ahead = self._ahead.pop(layer, None)
        counts = self.per_layer.setdefault(layer, [0, 0])
        used = ahead.used if ahead is not None else set()
        hit = sum(1 for e in needed if e in used)
        counts[0] += hit
        counts[1] += len(needed) - hit
        self.hits += hit
        self.misses += len(needed) - hit
        if ahead is not None:
            # wrong guesses: read all the same (their bytes wasted), finishing in the background
            self._outstanding.extend(job for e, job in ahead.jobs.items() if e not in used)
            self.wasted_bytes += sum(r.numel() * r.element_size() for e, rows in ahead.rows.items()
                                     if e not in used for r in rows.values())

    def settle(self) -> None:
        """A forward call ends (or the next begins): the reads still under way are waited for (a read error
        surfaces here, at the latest) and dropped: no read outlives the call that started it."""
        pending = self._outstanding + [job for ahead in self._ahead.values() for job in ahead.jobs.values()]
        self._outstanding, self._ahead = [], {}
        errors = [job.exception() for job in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def reset(self) -> None:
        for job in self._outstanding:
            job.exception()
        self._outstanding.clear()
        self._ahead.clear()
        self.hits = self.misses = self.wasted_bytes = self.predicted = 0
        self.per_layer.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self, decode_tokens: int) -> dict:
        recall = {str(layer): h / (h + m) if h + m else None for layer, (h, m) in sorted(self.per_layer.items())}
        return {"lookahead": self.distance, "lookahead_hits": self.hits, "lookahead_misses": self.misses,
                "lookahead_wasted_bytes_per_token": self.wasted_bytes / decode_tokens if decode_tokens else 0.0,
                "lookahead_recall": recall}


def _read_all(reads) -> None:
    for src, expert, buf in reads:
        src.read_rows([expert], buf)


def lookahead_stats(la: Lookahead | None, decode_tokens: int) -> dict:
    if la is None:
        return {"lookahead": 0, "lookahead_hits": 0, "lookahead_misses": 0, "lookahead_wasted_bytes_per_token": 0.0,
                "lookahead_recall": {}}
    return la.stats(decode_tokens)
