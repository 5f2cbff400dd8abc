"""One short check of the CUDA paths (pinned slabs, UVA views, prefetch), for a machine with a GPU.

    .venv/bin/python benchmarks/gpu_check.py            # exit 0: all PASS, 1: a FAIL; JSON to $OUT or bench-out

Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0.
(`--allow-cpu` runs the same steps on the CPU, skipping the CUDA-only checks: a dry run of
the script itself.)

Model: make_tiny qwen3_moe (default hidden 512, 8 layers, 32 experts, top-2, bf16) in a
temporary folder. Loads: all resident; experts offloaded (sparse-first, half the model) with
backend uva and with prefetch; declaration order at the same budget with each backend.
Checks (a PASS or FAIL line each):
- UVA views make no device copy: torch.cuda.memory_allocated() after the load grows by at
  most the resident bytes plus a small slack (not by resident + offloaded);
- uva: every offloaded parameter is a CUDA tensor whose data_ptr lies in a registered slab
  (runtime.arena.owns); prefetch: a pinned host tensor in a slab;
- the host arena's bytes equal the plan's offloaded bytes within 1%;
- greedy tokens (32 new) equal across all-resident / uva / prefetch (and declaration);
- the audit is empty.
Then tok/s (median of 3 after a warm-up, 64 new tokens) of every load, printed as a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

GIB = 2 ** 30
ROOT = Path(__file__).resolve().parent.parent


class Checks:
    def __init__(self):
        self.rows: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"check": name, "result": "PASS" if ok else "FAIL", "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "result": "SKIP", "detail": why})
        print(f"SKIP  {name}  ({why})", flush=True)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["result"] == "FAIL"]


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _allocated(dev) -> int:
    import torch

    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _generate(model, ids, n: int):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def _tok_s(model, ids, n: int, runs: int, dev) -> tuple[float, list[float]]:
    _generate(model, ids, n)                                   # warm-up
    times = []
    for _ in range(runs):
        _sync(dev)
        t0 = time.perf_counter()
        _generate(model, ids, n)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times), times


def _release(model) -> None:
    """Detach the runtime and unregister its pinned slabs; the memory goes when the model is collected."""
    rt = getattr(model, "moe_offload_runtime", None)
    if rt is not None:
        rt.detach()
        rt.arena.release()


def run_case(case: dict, folder: Path, ids, args, dev, checks: Checks, slack: int) -> dict:
    """Load one configuration, check its placement, record its tokens, tok/s and link bytes."""
    import torch

    import moe_offload

    label = case["label"]
    gc.collect()
    _sync(dev)
    before = _allocated(dev)
    t0 = time.perf_counter()
    model, plan = moe_offload.load(folder, device=str(dev), backend=case["backend"], policy=case["policy"],
                                   offload_gb=case["offload_gb"])
    _sync(dev)
    load_s = time.perf_counter() - t0
    grown = _allocated(dev) - before
    rt = model.moe_offload_runtime
    try:
        out = {"label": label, "backend": case["backend"], "policy": case["policy"], "load_s": load_s,
               "mechanism": rt.mechanism, "arena_mechanism": rt.arena.mechanism,
               "resident_bytes": plan.resident_bytes, "offloaded_bytes": plan.offloaded_bytes,
               "host_arena_bytes": rt.host_bytes, "device_bytes_after_load": grown,
               "planned_link_bytes_per_token": plan.link_bytes_per_token()}

        audit = moe_offload.audit(model, plan)
        checks.check(f"{label}: audit empty", not audit, f"{len(audit)} mismatches, first {audit[:2]}" if audit else "")

        if dev.type == "cuda":
            limit = plan.resident_bytes + slack
            checks.check(f"{label}: no device copy of offloaded weights (memory_allocated)", grown <= limit,
                         f"grew {grown / 2**20:.1f} MiB; resident {plan.resident_bytes / 2**20:.1f} MiB + slack "
                         f"{slack / 2**20:.0f} MiB; offloaded {plan.offloaded_bytes / 2**20:.1f} MiB")
        else:
            checks.skip(f"{label}: no device copy of offloaded weights", "no CUDA device")

        if plan.offloaded_bytes:
            arena, host = rt.host_bytes, plan.offloaded_bytes
            checks.check(f"{label}: host arena bytes == offloaded bytes within 1%", abs(arena - host) <= 0.01 * host,
                         f"arena {arena} B, offloaded {host} B, ratio {arena / host:.5f}")
            params = dict(model.named_parameters(remove_duplicate=False))
            offl = [t.name for t in plan.tensors if t.tier != "device" and t.name in params]
            bad_owner = [n for n in offl if not rt.arena.owns(params[n])]
            checks.check(f"{label}: offloaded params lie in the host slabs (arena.owns)", not bad_owner,
                         f"{len(offl)} params; not in a slab: {bad_owner[:3]}")
            if dev.type == "cuda":
                unregistered = [s.region for s in rt.arena.slabs if not s.registered]
                checks.check(f"{label}: every slab is cudaHostRegister'ed", not unregistered,
                             f"{len(rt.arena.slabs)} slabs; unregistered: {unregistered[:3]}")
                unpinned = [s.region for s in rt.arena.slabs if not s.host.is_pinned()]
                checks.check(f"{label}: every slab reads as pinned (Tensor.is_pinned)", not unpinned,
                             f"not pinned: {unpinned[:3]}")
                if case["backend"] == "uva":
                    not_cuda = [n for n in offl if not params[n].is_cuda]
                    checks.check(f"{label}: offloaded params are CUDA tensors (UVA views)", not not_cuda,
                                 f"not CUDA: {not_cuda[:3]}")
                    views = [s for s in rt.arena.slabs if s.view is None or s.view.data_ptr() != s.host.data_ptr()]
                    checks.check(f"{label}: each slab's device view aliases its host address", not views,
                                 f"bad: {[s.region for s in views][:3]}")
                else:
                    on_cuda = [n for n in offl if params[n].is_cuda]
                    checks.check(f"{label}: prefetch keeps offloaded params in host memory", not on_cuda,
                                 f"on CUDA: {on_cuda[:3]}")
            else:
                checks.skip(f"{label}: pinned slabs / CUDA views", "no CUDA device")

        # Greedy tokens for the cross-backend comparison, and first-step logits for a diagnosis if they differ.
        with torch.no_grad():
            out["prefill_logits"] = model(ids).logits[0, -1].float().cpu()
        tokens = _generate(model, ids, args.check_tokens)[0, ids.shape[1]:].tolist()
        out["tokens"] = tokens
        audit = moe_offload.audit(model, plan)
        checks.check(f"{label}: audit empty after generate", not audit, f"first {audit[:2]}" if audit else "")

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        rt.counter.reset()
        out["tok_s"], out["decode_s"] = _tok_s(model, ids, args.bench_tokens, args.runs, dev)
        out["measured_link_bytes_per_token"] = rt.counter.decode_bytes_per_token()
        out["peak_device_bytes_decode"] = torch.cuda.max_memory_allocated(dev) - before if dev.type == "cuda" else None
    finally:
        # Unregister before the slabs can be freed: a freed-but-registered range makes a later
        # cudaHostRegister of reused addresses fail (cudaErrorHostMemoryAlreadyRegistered).
        _release(model)
    return out


def machine(dev) -> dict:
    import torch
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}")
    return info


def print_table(cases: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="gpu_check: same model, same offload budget")
    for col in ("load", "policy", "backend", "offloaded MiB", "dev MiB after load", "planned link MiB/tok",
                "measured link MiB/tok", "tok/s", "load s"):
        t.add_column(col, justify="left" if col in ("load", "policy", "backend") else "right")
    for c in cases:
        t.add_row(c["label"], c["policy"], c["backend"], f"{c['offloaded_bytes'] / 2**20:.1f}",
                  f"{c['device_bytes_after_load'] / 2**20:.1f}", f"{c['planned_link_bytes_per_token'] / 2**20:.2f}",
                  f"{c['measured_link_bytes_per_token'] / 2**20:.2f}", f"{c['tok_s']:.2f}", f"{c['load_s']:.2f}")
    (Console() if sys.stdout.isatty() else Console(width=160)).print(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--bench-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--time-limit", type=int, default=330, help="abort (FAIL) after this many seconds")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: nothing to check (gpu_check needs torch.cuda; this torch is "
              f"{torch.__version__}, cuda {torch.version.cuda})")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _timeout(signum, frame):
        raise TimeoutError(f"gpu_check ran past --time-limit {args.time_limit} s")

    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(args.time_limit)

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-out"
    out_dir.mkdir(parents=True, exist_ok=True)
    checks, cases, report = Checks(), [], {"machine": machine(dev)}
    t_start = time.perf_counter()
    print(f"gpu_check on {report['machine'].get('gpu', dev)} (torch {torch.__version__}, cuda {torch.version.cuda})",
          flush=True)
    try:
        from transformers import AutoTokenizer

        import moe_offload
        from moe_offload.prompts import PROMPTS
        from moe_offload.tiny import make_tiny

        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            t0 = time.perf_counter()
            folder = make_tiny(Path(tmp) / "model", family="qwen3_moe", hidden=args.hidden, layers=args.layers,
                               experts=args.experts, top_k=args.top_k, dtype="bfloat16")
            total = moe_offload.plan(folder, offload_gb=0).total_bytes
            half_gb = total / 2 / GIB
            report["model"] = dict(family="qwen3_moe", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                   top_k=args.top_k, dtype="bfloat16", total_bytes=total, offload_gb=half_gb,
                                   make_s=time.perf_counter() - t0)
            print(f"model: {total / 2**20:.1f} MiB, offload budget {half_gb * 1024:.1f} MiB "
                  f"(made in {report['model']['make_s']:.0f} s)", flush=True)
            ids = AutoTokenizer.from_pretrained(folder)(PROMPTS[0], return_tensors="pt").input_ids.to(dev)
            slack = 32 * 2**20
            specs = [dict(label="resident", backend="uva", policy="sparse-first", offload_gb=0),
                     dict(label="sparse-first/uva", backend="uva", policy="sparse-first", offload_gb=half_gb),
                     dict(label="sparse-first/prefetch", backend="prefetch", policy="sparse-first",
                          offload_gb=half_gb),
                     dict(label="declaration/uva", backend="uva", policy="declaration", offload_gb=half_gb),
                     dict(label="declaration/prefetch", backend="prefetch", policy="declaration",
                          offload_gb=half_gb)]
            for spec in specs:
                try:
                    cases.append(run_case(spec, folder, ids, args, dev, checks, slack))
                except TimeoutError:
                    raise
                except Exception as exc:  # record and go on: one run of this script should say as much as it can
                    traceback.print_exc()
                    checks.check(f"{spec['label']}: load, check and decode without error", False,
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    gc.collect()

        by = {c["label"]: c for c in cases}
        ref = by.get("resident")
        if ref is not None:
            for label in ("sparse-first/uva", "sparse-first/prefetch", "declaration/uva", "declaration/prefetch"):
                c = by.get(label)
                if c is None:
                    continue
                same = c["tokens"] == ref["tokens"]
                first = next((i for i, (a, b) in enumerate(zip(c["tokens"], ref["tokens"])) if a != b), None)
                diff = (c["prefill_logits"] - ref["prefill_logits"]).abs().max().item()
                checks.check(f"greedy tokens equal: resident vs {label} ({args.check_tokens} new)", same,
                             f"max |prefill logit diff| {diff:.3g}" + ("" if same else f"; first differs at {first}"))
        for label in ("sparse-first/uva", "sparse-first/prefetch"):
            c = by.get(label)
            if c is not None:
                checks.check(f"{label}: measured link bytes per token > 0 (experts read from the host tier)",
                             c["measured_link_bytes_per_token"] > 0,
                             f"{c['measured_link_bytes_per_token'] / 2**20:.2f} MiB/token")
        if cases:
            print_table(cases)
    except Exception as exc:
        traceback.print_exc()
        checks.check("gpu_check ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        signal.alarm(0)
        for c in cases:
            c.pop("prefill_logits", None)
        report.update(cases=cases, checks=checks.rows, wall_s=time.perf_counter() - t_start,
                      passed=not checks.failed)
        path = out_dir / "gpu_check.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path} ({report['wall_s']:.0f} s); "
              f"{sum(r['result'] == 'PASS' for r in checks.rows)} PASS, {len(checks.failed)} FAIL, "
              f"{sum(r['result'] == 'SKIP' for r in checks.rows)} SKIP", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
