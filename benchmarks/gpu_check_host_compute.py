"""Host compute (issue 27) in benchmarks/gpu_check.py: offloaded experts computed by the CPU kernels where they lie,
against streaming them to the device and against the resident model, on the accelerator.

One qwen3_moe bf16 checkpoint (the check's sizes) with 80% of its routed-expert bytes on the host tier
(`offload_params="experts"`), loaded four ways: resident (nothing offloaded), `expert_compute="host"`, `"device"`
(streaming: the runtime before host compute) and `"auto"` (the cost model, with the link and the host measured
here). Checks and figures:
- host compute's greedy tokens (32) against the resident run's, by the margin rule (the CPU kernels accumulate in
  float32, the GPU's matmuls otherwise: equal up to the first near tie);
- the link: host compute's weight bytes per decoded token are those of the experts it did not compute (split
  layers) and its activation bytes are > 0; streaming's activation bytes are 0;
- decode tok/s of each load (64 tokens, median of the check's runs) and host over streaming, with the cost model's
  predicted ratio beside it (planning/cost_model.py on layer_shape(plan), the measured rates);
- prefill tokens/s of a 512-token prompt under auto, host and device: auto within 10% of the better forced choice.
Alone: `gpu_check.py --only host`.
"""

from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path

from gpu_check_compiled import margin_rule
from gpu_check_harness import GIB, Checks, Guard, StepTimeout
from gpu_check_load import _sync

PREFILL = 512


def _decode(model, ids, n: int, runs: int, dev):
    import torch

    times, tokens = [], None
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=[])    # warm
        for _ in range(runs):
            _sync(dev)
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])
            _sync(dev)
            times.append(time.perf_counter() - t)
            tokens = out[0, ids.shape[1]:].tolist()
    return tokens, n / statistics.median(times)


def _prefill(model, n: int, runs: int, dev) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, n), device=dev)
    times = []
    with torch.no_grad():
        model(input_ids=ids)
        for _ in range(runs):
            _sync(dev)
            t = time.perf_counter()
            model(input_ids=ids)
            _sync(dev)
            times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def _reference(model, ids, n: int):
    import torch

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[], output_logits=True,
                             return_dict_in_generate=True)
    top = torch.stack([s[0] for s in out.logits]).float().topk(2, dim=-1).values
    return out.sequences[0, ids.shape[1]:].tolist(), (top[:, 0] - top[:, 1]).tolist()


def host_compute_section(tmp: Path, args, dev, guard: Guard, checks: Checks, report: dict, write) -> None:
    import moe_offload as mo
    from moe_offload.planning.cost_model import crossover_tokens, expected_step, layer_shape
    from moe_offload.tiny.make import make_tiny

    section = report.setdefault("host_compute", {"loads": []})
    try:
        with guard.limit("make host-compute model", args.case_limit):
            folder = make_tiny(tmp / "host-compute", family="qwen3_moe", dtype="bfloat16", hidden=args.hidden,
                               layers=args.layers, experts=args.experts, top_k=args.top_k)
            experts = mo.plan(folder, offload_gb=0).roles()["routed_expert"]["bytes"]
    except (StepTimeout, Exception) as exc:
        traceback.print_exc()
        checks.check("host compute: make_tiny qwen3_moe bf16", False, f"{type(exc).__name__}: {exc}")
        return
    from transformers import AutoTokenizer
    from moe_offload.prompts import PROMPTS

    ids = AutoTokenizer.from_pretrained(folder)(PROMPTS[0], return_tensors="pt").input_ids.to(dev)
    off = dict(offload_params="experts", offload_gb=0.8 * experts / GIB)
    loads = [("resident", dict(offload_gb=0)), ("host", dict(off, expert_compute="host")),
             ("device", dict(off, expert_compute="device")), ("auto", dict(off, expert_compute="auto"))]
    rows, want = {}, None
    for label, kw in loads:
        try:
            with guard.limit(f"host compute {label}", args.case_limit):
                with mo.load(folder, device=dev, **kw) as loaded:
                    rt = loaded.runtime
                    if label == "resident":
                        want = _reference(loaded.model, ids, args.check_tokens)
                    tokens, tok_s = _decode(loaded.model, ids, args.bench_tokens, args.runs, dev)
                    for c in (rt.counter, rt.activation_counter):
                        c.reset()
                    got, _ = _decode(loaded.model, ids, args.check_tokens, 1, dev)
                    row = {"load": label, "tok_s": tok_s, "tokens": got,
                           "link_bytes_per_token": rt.counter.decode_bytes_per_token(),
                           "link_activation_bytes_per_token": rt.activation_counter.decode_bytes_per_token(),
                           "prefill_tok_s": _prefill(loaded.model, PREFILL, args.runs, dev),
                           "mechanism": rt.mechanism}
                    if rt.host_compute is not None:
                        row.update(rt.host_compute.stats())
                        if rt.host_compute.hardware is not None:
                            hw = rt.host_compute.hardware
                            row["hardware"] = {"host_bytes_per_s": hw.host_bytes_per_s,
                                               "host_flops_per_s": hw.host_flops_per_s,
                                               "link_bytes_per_s": hw.link_bytes_per_s}
                            shape = layer_shape(loaded.plan)
                            one = expected_step(hw, shape, 1)
                            row["predicted_host_over_stream_decode"] = one.stream_s / one.host_s
                            row["predicted_crossover_tokens"] = crossover_tokens(hw, shape)
                    rows[label] = row
                    section["loads"].append(row)
                    print(f"host compute {label}: decode {tok_s:.1f} tok/s, prefill {row['prefill_tok_s']:.0f} tok/s, "
                          f"link {row['link_bytes_per_token'] / 1e6:.2f} MB/token "
                          f"({row['link_activation_bytes_per_token'] / 1e3:.1f} KB activations)", flush=True)
        except (StepTimeout, Exception) as exc:
            traceback.print_exc()
            checks.check(f"host compute {label}: load, decode, prefill", False, f"{type(exc).__name__}: {exc}")
        write()
    if want is not None and "host" in rows:
        margin_rule("host compute: tokens equal resident (margin rule)", rows["host"]["tokens"], want[0], want[1],
                    checks)
    if "host" in rows and "device" in rows:
        h, d = rows["host"], rows["device"]
        checks.check("host compute: activations cross the link, streaming sends none",
                     h["link_activation_bytes_per_token"] > 0 and d["link_activation_bytes_per_token"] == 0,
                     f"{h['link_activation_bytes_per_token']:.0f} / {d['link_activation_bytes_per_token']:.0f} B")
        checks.check("host compute: fewer link bytes than streaming", h["link_bytes_per_token"] < d["link_bytes_per_token"],
                     f"{h['link_bytes_per_token'] / 1e6:.2f} vs {d['link_bytes_per_token'] / 1e6:.2f} MB/token")
        section["host_over_stream_decode"] = h["tok_s"] / d["tok_s"]
        print(f"host compute: decode host / streaming {section['host_over_stream_decode']:.2f}x (goal >= 1.5x)",
              flush=True)
    if all(k in rows for k in ("auto", "host", "device")):
        best = max(rows["host"]["prefill_tok_s"], rows["device"]["prefill_tok_s"])
        checks.check("host compute: auto's prefill within 10% of the better forced choice",
                     rows["auto"]["prefill_tok_s"] >= 0.9 * best,
                     f"auto {rows['auto']['prefill_tok_s']:.0f}, host {rows['host']['prefill_tok_s']:.0f}, device "
                     f"{rows['device']['prefill_tok_s']:.0f} tok/s")
    write()
