"""Routing traces: which experts the routers picked, token by token (the format of docs/cli.md).

A trace is JSON Lines. Line 1 is the header; every other line is one token of one sequence:

    {"format": "moe-offload-trace", "version": 1, "model_type": "mixtral", "num_experts": 8, "top_k": 2,
     "layers": [0, 1], "source": "..."}
    {"seq": 0, "pos": 0, "phase": "prefill", "experts": [[6, 5], [3, 1]]}
    {"seq": 0, "pos": 3, "phase": "decode", "experts": [[2, 5], [3, 0]], "predicted": [[], [3, 7]]}

`predicted` (optional, additive to version 1): per layer, the experts a look-ahead predictor named before that
layer routed (`profile --predict`); `replay` counts look-ahead hits, misses and wasted bytes from it.

`profile` writes traces (TraceWriter), `plan --stats` and `replay` read them (read_trace).
Every rule of the format is checked on reading, and a broken rule is a TraceError that names
the file and the line: a trace is user input, often converted from another tool.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import TraceError

FORMAT = "moe-offload-trace"
VERSION = 1


class Phase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class TraceHeader:
    model_type: str
    num_experts: int
    top_k: int
    layers: tuple[int, ...]   # decoder-layer indices with routed experts, ascending; rows list them in this order
    source: str = ""

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model_type": self.model_type, "num_experts": self.num_experts,
                "top_k": self.top_k, "layers": list(self.layers), "source": self.source}


@dataclass(frozen=True)
class TraceRow:
    seq: int
    pos: int
    phase: str                              # "prefill" or "decode"
    experts: tuple[tuple[int, ...], ...]    # per header layer: the distinct expert ids picked there
    # optional, decode rows: per header layer, the experts a look-ahead predictor named before that layer routed
    predicted: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict:
        d = {"seq": self.seq, "pos": self.pos, "phase": self.phase, "experts": [list(e) for e in self.experts]}
        if self.predicted is not None:
            d["predicted"] = [list(e) for e in self.predicted]
        return d


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    rows: tuple[TraceRow, ...]
    path: str = ""   # where it was read from, for messages; "" when built in memory

    @property
    def decode_rows(self) -> tuple[TraceRow, ...]:
        return tuple(r for r in self.rows if r.phase == Phase.DECODE)

    @property
    def name(self) -> str:
        return self.path or "the trace"


# --- validation --------------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return type(value) is int   # JSON true/false are bools, and 1.0 is not an id


def _header_from(obj, where: str) -> TraceHeader:
    fix = f"line 1 must be the header {{\"format\": \"{FORMAT}\", \"version\": {VERSION}, ...}} (docs/cli.md)"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: the header is not a JSON object; {fix}")
    if obj.get("format") != FORMAT:
        raise TraceError(f"{where}: format {obj.get('format')!r} is not {FORMAT!r}: not a moe-offload trace; {fix}")
    if obj.get("version") != VERSION:
        raise TraceError(f"{where}: trace version {obj.get('version')!r}, this moe-offload reads version {VERSION}; "
                         "write the trace again with `moe-offload profile`")
    model_type, e, k, layers = obj.get("model_type"), obj.get("num_experts"), obj.get("top_k"), obj.get("layers")
    if not isinstance(model_type, str):
        raise TraceError(f"{where}: model_type {model_type!r} is not a string; give the config's model_type")
    if not _is_int(e) or e < 1:
        raise TraceError(f"{where}: num_experts {e!r} is not a positive integer; give the config's expert count")
    if not _is_int(k) or not 1 <= k <= e:
        raise TraceError(f"{where}: top_k {k!r} is not an integer from 1 to num_experts ({e}); give the config's "
                         "experts per token")
    if not isinstance(layers, list) or not layers or not all(_is_int(x) and x >= 0 for x in layers):
        raise TraceError(f"{where}: layers {layers!r} is not a non-empty list of layer indices (integers >= 0)")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise TraceError(f"{where}: layers {layers} are not distinct and ascending; list each routed layer once, "
                         "in model order")
    source = obj.get("source", "")
    if not isinstance(source, str):
        raise TraceError(f"{where}: source {source!r} is not a string")
    return TraceHeader(model_type, e, k, tuple(layers), source)


def _row_from(obj, header: TraceHeader, where: str) -> TraceRow:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a token row must be a JSON object with seq, pos, phase and experts")
    seq, pos, phase, experts = obj.get("seq"), obj.get("pos"), obj.get("phase"), obj.get("experts")
    if not _is_int(seq) or seq < 0:
        raise TraceError(f"{where}: seq {seq!r} is not an integer >= 0 (the sequence this token belongs to)")
    if not _is_int(pos) or pos < 0:
        raise TraceError(f"{where}: pos {pos!r} is not an integer >= 0 (the token's position in its sequence)")
    if phase not in (Phase.PREFILL.value, Phase.DECODE.value):
        raise TraceError(f"{where}: phase {phase!r} is neither 'prefill' nor 'decode'")
    n = len(header.layers)
    if not isinstance(experts, list) or len(experts) != n:
        count = len(experts) if isinstance(experts, list) else "no"
        raise TraceError(f"{where}: experts has {count} lists but the header names {n} layers {list(header.layers)}; "
                         "give one list of expert ids per header layer, in header order")
    picks = []
    for layer, ids in zip(header.layers, experts):
        if not isinstance(ids, list) or not all(_is_int(x) for x in ids):
            raise TraceError(f"{where}: layer {layer}: {ids!r} is not a list of integer expert ids")
        if len(ids) > header.top_k:
            raise TraceError(f"{where}: layer {layer}: {len(ids)} experts picked but top_k is {header.top_k}")
        if ids and (min(ids) < 0 or max(ids) >= header.num_experts):
            bad = next(x for x in ids if not 0 <= x < header.num_experts)
            raise TraceError(f"{where}: layer {layer}: expert id {bad} is outside 0..{header.num_experts - 1} "
                             f"(num_experts {header.num_experts})")
        if len(set(ids)) != len(ids):
            raise TraceError(f"{where}: layer {layer}: expert ids {ids} repeat; list each picked expert once")
        picks.append(tuple(ids))
    predicted = obj.get("predicted")
    if predicted is not None:
        if not isinstance(predicted, list) or len(predicted) != n or not all(
                isinstance(ids, list) and all(_is_int(x) and 0 <= x < header.num_experts for x in ids)
                and len(set(ids)) == len(ids) for ids in predicted):
            raise TraceError(f"{where}: predicted must be one list per header layer ({n}) of distinct expert ids "
                             f"in 0..{header.num_experts - 1}, as `experts`; got {predicted!r:.80}")
        predicted = tuple(tuple(ids) for ids in predicted)
    return TraceRow(seq, pos, phase, tuple(picks), predicted)


def read_trace(path) -> Trace:
    """Read and check a trace file; a TraceError names the file and line of the first broken rule."""
    path = Path(path)
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}; record one with `moe-offload profile MODEL "
                         "--out TRACE`") from exc
    header = None
    rows = []
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                where = f"{path}:{number}"
                if not line.strip():
                    raise TraceError(f"{where}: empty line; a trace holds one JSON object per line")
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
                if header is None:
                    header = _header_from(obj, where)
                else:
                    rows.append(_row_from(obj, header, where))
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start} of a line)") from None
    if header is None:
        raise TraceError(f"{path}:1: the file is empty; a trace starts with its header line")
    return Trace(header, tuple(rows), str(path))


def check_trace_matches(trace: Trace, *, num_experts: int | None, layers: Sequence[int], where: str) -> None:
    """A trace used with a model must name that model's experts and routed layers."""
    if num_experts != trace.header.num_experts:
        raise TraceError(f"{trace.name} records {trace.header.num_experts} experts per layer but {where} has "
                         f"{num_experts}: the trace is of another model; profile this model to get its trace")
    want, got = tuple(layers), trace.header.layers
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        detail = "; ".join(s for s in (f"missing {missing}" if missing else "",
                                       f"not routed in the model {extra}" if extra else "") if s) or "other order"
        raise TraceError(f"{trace.name} records routed layers {list(got)} but {where} routes layers {list(want)} "
                         f"({detail}): the trace is of another model; profile this model to get its trace")


# --- writing -----------------------------------------------------------------------------------------------


class TraceWriter:
    """Streams rows to a trace file that appears whole on close() and not at all on error.

        with TraceWriter(path, header) as w:
            w.add(TraceRow(0, 0, "prefill", ((1, 3), (0, 2))))
    """

    def __init__(self, path, header: TraceHeader):
        _header_from(header.to_dict(), "trace header")   # the writer never writes what the reader refuses
        self.path = Path(path)
        self.header = header
        self.rows = 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            self._file = self._tmp.open("w", encoding="utf-8")
            self._file.write(json.dumps(header.to_dict()) + "\n")
        except OSError as exc:
            self._tmp.unlink(missing_ok=True)
            raise TraceError(f"cannot write trace {self.path}: {exc.strerror}; choose a writable path") from exc

    def add(self, row: TraceRow) -> None:
        _row_from(row.to_dict(), self.header, f"trace row {self.rows + 1}")
        self._file.write(json.dumps(row.to_dict()) + "\n")
        self.rows += 1

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.close()
            os.replace(self._tmp, self.path)
        except OSError as exc:
            self._tmp.unlink(missing_ok=True)
            raise TraceError(f"cannot write trace {self.path}: {exc.strerror}; choose a writable path") from exc

    def abort(self) -> None:
        """Drop everything written so far: the target file is left as it was."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_trace(path, header: TraceHeader, rows: Iterable[TraceRow]) -> None:
    """Write a whole trace atomically (a temporary sibling renamed into place)."""
    with TraceWriter(path, header) as writer:
        for row in rows:
            writer.add(row)


# --- statistics --------------------------------------------------------------------------------------------


def _phase_rows(trace: Trace, phase: str | None) -> Iterable[TraceRow]:
    return trace.rows if phase is None else (r for r in trace.rows if r.phase == phase)


def expert_counts(traces: Trace | Iterable[Trace], phase: str | None = "decode") -> dict[int, list[int]]:
    """layer -> tokens (of `phase`; None: all) that picked each expert, summed over traces of one model."""
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    if not traces:
        raise TraceError("no trace given: pass at least one routing trace")
    first = traces[0].header
    for t in traces[1:]:
        if (t.header.num_experts, t.header.layers) != (first.num_experts, first.layers):
            raise TraceError(f"{t.name} ({t.header.num_experts} experts, layers {list(t.header.layers)}) and "
                             f"{traces[0].name} ({first.num_experts} experts, layers {list(first.layers)}) are "
                             "traces of different models: give traces of one model")
    n = len(first.layers)
    counts = np.zeros((n, first.num_experts), dtype=np.int64)
    for t in traces:
        rows = list(_phase_rows(t, phase))
        if not rows:
            continue
        picks = routing_array(rows, max(1, max(len(ids) for r in rows for ids in r.experts)), n)
        for i in range(n):
            col = picks[:, i, :].ravel()
            counts[i] += np.bincount(col[col >= 0], minlength=first.num_experts)   # ids are distinct per token
    return {layer: counts[i].tolist() for i, layer in enumerate(first.layers)}


def routing_array(rows: Sequence[TraceRow], width: int, layers: int, dtype=np.int32) -> np.ndarray:
    """Rows as an integer array [T, layers, width] of expert ids, padded with -1 where fewer were picked."""
    out = np.full((len(rows), layers, width), -1, dtype=dtype)
    for t, row in enumerate(rows):
        for i, ids in enumerate(row.experts):
            out[t, i, :len(ids)] = ids
    return out


def skew_summary(trace: Trace, phase: str | None = "decode") -> list[dict]:
    """Per layer, how unevenly the tokens of `phase` (None: all) spread over the experts.

    tokens: tokens counted; top10_share: share of expert picks served by the busiest 10% of the
    experts (at least one; uniform routing gives about 0.1); effective_experts: exp(entropy) of the
    pick distribution (num_experts when uniform, top_k when a layer always picks the same ones);
    max_over_mean: picks of the busiest expert over the mean; unused: experts never picked.
    """
    counts = expert_counts(trace, phase)
    tokens = sum(1 for _ in _phase_rows(trace, phase))
    busiest = max(1, math.ceil(trace.header.num_experts / 10))
    out = []
    for layer, row in counts.items():
        c = np.asarray(row, dtype=np.float64)
        total = c.sum()
        p = c[c > 0] / total if total else c[:0]
        out.append({
            "layer": layer,
            "tokens": tokens,
            "top10_share": float(np.sort(c)[::-1][:busiest].sum() / total) if total else 0.0,
            "effective_experts": float(np.exp(-(p * np.log(p)).sum())) if total else 0.0,
            "max_over_mean": float(c.max() / c.mean()) if total else 0.0,
            "unused": int((c == 0).sum()),
        })
    return out
