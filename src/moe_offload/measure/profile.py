"""`profile`: record which experts the routers pick, token by token, as a routing trace (traces.py).

The routing comes from the runtime's own experts function (experts.py): it sees
`top_k_index` of every MoE layer on every forward call and hands it to `Runtime.recorder`.
There is no second mechanism (no router hooks), so a trace holds exactly what the runtime
reads from.

Each prompt is decoded greedily, one sequence at a time. Its tokens are the prefill rows
(pos 0..n-1); then every generated token is run through the model as a decode step (pos n,
n+1, ...): with --max-new-tokens N that is N decode rows per prompt, the N-th token's
routing included (the model is run once more than generating N tokens needs, and what it
predicts then is dropped). Generation stops early at EOS (the EOS token itself is never
run through the model, so it has no row) unless `ignore_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..errors import MoeOffloadError
from ..run.state import RoutedCall
from ..planning.placement import Plan
from ..formats.traces import Phase, TraceHeader, TraceRow, TraceWriter, read_trace, skew_summary
from .timing import pad_token_id, past_eos
from ..run.runtime import runtime_of

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class SequenceRecord:
    seq: int
    prompt_tokens: int   # prefill rows
    decode_tokens: int   # decode rows: generated tokens run through the model
    text: str            # the generated tokens that have rows


@dataclass(frozen=True)
class ProfileResult:
    out: str
    header: TraceHeader
    sequences: tuple[SequenceRecord, ...]
    skew: list[dict] = field(default_factory=list)   # traces.skew_summary of the decode tokens, per layer

    def to_dict(self) -> dict:
        return {
            "out": self.out,
            "model_type": self.header.model_type,
            "num_experts": self.header.num_experts,
            "top_k": self.header.top_k,
            "layers": list(self.header.layers),
            "sequences": len(self.sequences),
            "prefill_tokens": sum(s.prompt_tokens for s in self.sequences),
            "decode_tokens": sum(s.decode_tokens for s in self.sequences),
            "skew": self.skew,
        }


def trace_header(plan: Plan, source: str) -> TraceHeader:
    """The header of a trace of the model `plan` describes: its routed layers, E and k (from its config)."""
    routed = [t for t in plan.tensors if t.role == "routed_expert" and t.experts and t.layer is not None]
    if not routed:
        raise MoeOffloadError(f"this {plan.model_type} model has no routed experts: there is no routing to profile; "
                              "profile a Mixture-of-Experts model")
    layers = tuple(sorted({t.layer for t in routed}))
    return TraceHeader(plan.model_type, max(t.experts for t in routed), max(t.top_k or 0 for t in routed), layers,
                       source)


def _rows(seq: int, calls: Sequence[RoutedCall], header: TraceHeader, predictions=None) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for c, call in enumerate(calls):
        if tuple(call.experts) != header.layers:
            raise MoeOffloadError(f"the experts function saw routed layers {list(call.experts)} in one forward "
                                  f"call, but the model routes layers {list(header.layers)}; this model's experts "
                                  "modules do not all run through moe-offload's experts function")
        index = [call.experts[layer] for layer in header.layers]     # per layer: [tokens, k]
        if any(ix.shape[0] != call.tokens for ix in index):
            raise MoeOffloadError(f"a forward call of {call.tokens} token(s) routed "
                                  f"{[ix.shape[0] for ix in index]} rows per layer: profile runs one sequence at a "
                                  "time, so these must agree")
        lists = [ix.tolist() for ix in index]
        for i in range(call.tokens):
            # distinct ids, in the router's order
            experts = tuple(tuple(dict.fromkeys(ids[i])) for ids in lists)
            predicted = None
            if predictions is not None and call.decode:   # one token per decode call: the call's predictions
                predicted = tuple(tuple(predictions[c].get(layer, ())) for layer in header.layers)
            rows.append(TraceRow(seq, len(rows), Phase.DECODE.value if call.decode else Phase.PREFILL.value,
                                 experts, predicted))
    return rows


def record(model, tokenizer, prompts: Sequence[str], writer: TraceWriter, *, max_new_tokens: int,
           ignore_eos: bool = False, predict: bool = False) -> list[SequenceRecord]:
    """Decode each prompt greedily on a loaded model (offloaded or not) and write its tokens' routing.

    `predict`: decode rows also carry `predicted`, per layer the experts run/router_predictor.RouterPredictor names for it
    from the layer before (what `--lookahead 1` would read ahead), for replay to count."""
    runtime = runtime_of(model)
    calls: list[RoutedCall] = []
    predictions, handles = _predicting(model, calls) if predict else (None, [])
    kwargs = dict(max_new_tokens=max_new_tokens + 1, do_sample=False)
    if ignore_eos:
        kwargs.update(past_eos(model, tokenizer))   # no EOS at all for this call: exactly max_new_tokens decode steps
    elif getattr(model.generation_config, "pad_token_id", None) is None:
        kwargs["pad_token_id"] = pad_token_id(model, tokenizer)
    out = []
    previous = runtime.recorder
    runtime.recorder = calls.append
    try:
        for seq, prompt in enumerate(prompts):
            enc = tokenizer(prompt, return_tensors="pt").to(runtime.device)
            n = enc["input_ids"].shape[1]
            if n == 0:
                raise MoeOffloadError(f"prompt {seq + 1} encodes to no tokens: give non-empty prompts")
            calls.clear()
            if predictions is not None:
                predictions.clear()
            with torch.no_grad():
                generated = model.generate(**enc, **kwargs)[0, n:]
            rows = _rows(seq, calls, writer.header, predictions)
            for row in rows:
                writer.add(row)
            decoded = len(rows) - n
            out.append(SequenceRecord(seq, n, decoded, tokenizer.decode(generated[:decoded].tolist(),
                                                                        skip_special_tokens=True)))
    finally:
        runtime.recorder = previous
        for h in handles:
            h.remove()
    return out


def _predicting(model, calls: list) -> tuple[list[dict], list]:
    """Forward hooks on the decoder layers that note, per forward call, RouterPredictor's guess for each next
    layer (layer -> ids); returns (per call, its guesses) and the hook handles."""
    from ..model.inventory import layer_of, layer_prefix
    from ..run.router_predictor import RouterPredictor

    predictor = RouterPredictor(model)
    per_call: list[dict] = []
    handles = []

    def hook(target):
        def post(module, args, output):
            while len(per_call) <= len(calls):   # this call's dict (calls grows when a call ends)
                per_call.append({})
            hidden = output[0] if isinstance(output, tuple) else output
            per_call[len(calls)][target] = predictor.predict(target, hidden) or []   # used for decode rows only
        return post

    for name, mod in model.named_modules():
        if layer_prefix(name) == name and predictor.covers(layer_of(name) + 1):
            handles.append(mod.register_forward_hook(hook(layer_of(name) + 1)))
    return per_call, handles


def profile(model_dir, out, *, prompts: Sequence[str] | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
            ignore_eos: bool = False, device=None, dtype: str | None = None, predict: bool = False) -> ProfileResult:
    """Load MODEL with nothing offloaded, decode the prompts, write the trace to `out` (whole or not at all)."""
    from ..loading.loader import load, load_tokenizer
    from ..prompts import PROMPTS

    if max_new_tokens < 1:
        raise MoeOffloadError(f"--max-new-tokens {max_new_tokens}: give at least 1 (decode tokens are what the "
                              "frequency policy and replay use)")
    folder = Path(model_dir)
    builtin = prompts is None
    prompts = list(PROMPTS if builtin else prompts)
    if not prompts:
        raise MoeOffloadError("no prompts to profile: give a file with one prompt per line")
    out = Path(out)
    if not out.parent.is_dir():
        raise MoeOffloadError(f"cannot write {out}: the folder {out.parent} does not exist; create it first")
    tokenizer = load_tokenizer(folder)
    model, plan = load(folder, device=device, dtype=dtype, offload_gb=0)
    source = (f"moe-offload profile of {folder.name}: {len(prompts)} {'built-in' if builtin else 'given'} prompts, "
              f"greedy, up to {max_new_tokens} decode tokens each{', EOS ignored' if ignore_eos else ''}")
    header = trace_header(plan, source)
    with TraceWriter(out, header) as writer:
        sequences = record(model, tokenizer, prompts, writer, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                           predict=predict)
    trace = read_trace(out)   # the summary is of the file as written, read back through the checking reader
    skew = skew_summary(trace) if trace.decode_rows else []
    return ProfileResult(str(out), header, tuple(sequences), skew)


def print_summary(result: ProfileResult, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    h = result.header
    d = result.to_dict()
    table = Table(title=f"routing skew per layer: {h.model_type}, {h.num_experts} experts, top-{h.top_k}, "
                        f"{d['decode_tokens']} decode tokens")
    for col in ("layer", "tokens", "busiest 10% share", "effective experts", "max / mean", "unused"):
        table.add_column(col, justify="right")
    for row in result.skew:
        table.add_row(str(row["layer"]), str(row["tokens"]), f"{row['top10_share']:.1%}",
                      f"{row['effective_experts']:.1f}", f"{row['max_over_mean']:.2f}", str(row["unused"]))
    console.print(table)
    console.print(f"uniform routing: busiest 10% share about {max(1, -(-h.num_experts // 10)) / h.num_experts:.1%}, "
                  f"effective experts {h.num_experts}")
    console.print(f"wrote {d['prefill_tokens'] + d['decode_tokens']} token rows ({d['prefill_tokens']} prefill, "
                  f"{d['decode_tokens']} decode, {d['sequences']} sequences) to {result.out}")
