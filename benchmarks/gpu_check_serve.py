"""The server's decoding (issue 19) in benchmarks/gpu_check.py: transformers' continuous batching on the model
as moe_offload loaded it, on the accelerator.

One qwen3_moe bf16 checkpoint (the check's sizes), loaded at half its bytes offloaded with uva and with
prefetch; each load drives `serve.engine.Engine` in-process (no HTTP), as `moe-offload serve` does:
- one request alone: its greedy tokens equal `model.generate`'s (the margin rule of the compiled section: equal
  up to the reference's first near tie), and the engine's meter counts the same link bytes per decoded token as
  the runtime's counter over that generate;
- eight requests together (distinct prompts): each one's tokens against its own generate, under the same rule;
- a sampled request (temperature 1, seeded) twice: it completes on the device and draws the same tokens again;
- decode tok/s of the engine at 1 and at 8 requests (all tokens after the first over the time after the first
  token), and the CUDA memory allocated after the runs against before them (the paged KV cache is made once).
Alone: `gpu_check.py --only serve`.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from pathlib import Path

from gpu_check_compiled import margin_rule
from gpu_check_harness import GIB, MIB, Checks, Guard, StepTimeout
from gpu_check_load import _sync

CONCURRENT = 8


def _reference(model, ids: list[int], n: int, dev):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=dev), max_new_tokens=n, do_sample=False, eos_token_id=[],
                             output_logits=True, return_dict_in_generate=True)
    logits = torch.stack([s[0] for s in out.logits]).float()
    top = logits.topk(2, dim=-1).values
    return out.sequences[0, len(ids):].tolist(), (top[:, 0] - top[:, 1]).tolist()


def _serve(engine, prompts: list[list[int]], n: int, temperature: float = 0.0,
           seed: int | None = None) -> tuple[list[list[int]], float]:
    """Every prompt as one request (greedy unless a temperature is given), all at once; (tokens of each, decode
    tok/s of them together)."""
    from moe_offload.serve.protocol import TextRequest

    firsts, lasts = [], []

    async def one(ids):
        req = TextRequest("completion", tuple(ids), n, temperature, 1.0, seed, (), True, False, True)
        first = None
        async for ev in engine.generate(req):
            now = time.perf_counter()
            first = now if first is None else first
            if ev.finish:
                firsts.append(first)
                lasts.append(now)
                return ev.token_ids

    async def all_of():
        return await asyncio.gather(*(one(p) for p in prompts))

    tokens = asyncio.run(all_of())
    span = max(lasts) - min(firsts)
    return tokens, (len(prompts) * (n - 1)) / span if span > 0 else float("nan")


def serve_load(label: str, folder: Path, kwargs: dict, args, dev, checks: Checks) -> dict:
    import torch
    from transformers import AutoTokenizer

    import moe_offload
    from moe_offload.prompts import PROMPTS
    from moe_offload.serve.engine import Engine, Limits
    from moe_offload.serve.metrics import Meter

    tok = AutoTokenizer.from_pretrained(folder)
    n = args.check_tokens
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:CONCURRENT]]
    model, plan = moe_offload.load(folder, device=dev, **kwargs)
    rt = model.moe_offload_runtime
    refs = [_reference(model, p, n, dev) for p in prompts]
    rt.counter.reset()
    rt.disk_counter.reset()
    _reference(model, prompts[0], n, dev)
    want_link = rt.counter.decode_bytes_per_token() + rt.disk_counter.decode_bytes_per_token()
    meter = Meter(model)
    engine = Engine(model, tok, Limits(CONCURRENT, CONCURRENT, max(len(p) for p in prompts) + n + 8, 64))
    engine.start()
    out = {"label": label, "offloaded_bytes": plan.offloaded_bytes, "mechanism": rt.mechanism}
    try:
        _sync(dev)
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        alone, out["tok_s_1"] = _serve(engine, prompts[:1], n)
        per_token = sum(meter.per_token())
        margin_rule(f"serve {label}: a request alone equals generate", alone[0], *refs[0], checks)
        checks.check(f"serve {label}: the meter's link bytes per decoded token equal generate's", per_token == want_link,
                     f"{per_token:.0f} vs {want_link:.0f} B")
        together, out["tok_s_8"] = _serve(engine, prompts, n)
        for i, (got, (want, margins)) in enumerate(zip(together, refs)):
            margin_rule(f"serve {label}: request {i} of {CONCURRENT} together equals its generate", got, want, margins,
                        checks)
        # sampled (OpenAI's default temperature 1): drawn on the logits' device; a seed draws the same tokens again
        sampled = [_serve(engine, prompts[:1], n, temperature=1.0, seed=3)[0][0] for _ in range(2)]
        checks.check(f"serve {label}: a sampled request (temperature 1, seeded) completes, the same tokens twice",
                     len(sampled[0]) == n and sampled[0] == sampled[1], f"{sampled[0]} / {sampled[1]}")
        _serve(engine, prompts, n)
        _sync(dev)
        if before is not None:
            grown = torch.cuda.memory_allocated(dev) - before
            out["cuda_growth_bytes"] = grown
            checks.check(f"serve {label}: CUDA memory back to its level after the runs", grown <= 16 * MIB,
                         f"{grown / MIB:.1f} MiB more than before the first request")
        out["link_bytes_per_token_8"] = sum(meter.per_token())
    finally:
        engine.stop()
        meter.close()
    return out


def serve_section(tmp: Path, args, dev, guard: Guard, checks: Checks, report: dict, write) -> None:
    import moe_offload
    from moe_offload.tiny.make import make_tiny

    rows = report.setdefault("serve", [])
    try:
        with guard.limit("make serve model", args.case_limit):
            folder = make_tiny(tmp / "serve", family="qwen3_moe", dtype="bfloat16", hidden=args.hidden,
                               layers=args.layers, experts=args.experts, top_k=args.top_k)
            half_gb = moe_offload.plan(folder, offload_gb=0).total_bytes / 2 / GIB
    except (StepTimeout, Exception) as exc:
        traceback.print_exc()
        checks.check("serve: make_tiny qwen3_moe bf16", False, f"{type(exc).__name__}: {exc}")
        return
    for label, kwargs in (("uva", dict(offload_gb=half_gb, backend="uva")),
                          ("prefetch", dict(offload_gb=half_gb, backend="prefetch"))):
        try:
            with guard.limit(f"serve {label}", args.case_limit):
                rows.append(serve_load(label, folder, kwargs, args, dev, checks))
                print(f"serve {label}: decode tok/s 1 request {rows[-1]['tok_s_1']:.1f}, {CONCURRENT} together "
                      f"{rows[-1]['tok_s_8']:.1f}", flush=True)
        except (StepTimeout, Exception) as exc:
            traceback.print_exc()
            checks.check(f"serve {label} ran", False, f"{type(exc).__name__}: {exc}")
        write()
