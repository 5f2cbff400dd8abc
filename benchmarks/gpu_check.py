"""One short check of every CUDA path (slabs, UVA, prefetch, splits, cache, quantized, disk), for a GPU machine.

    .venv/bin/python benchmarks/gpu_check.py            # exit 0: all PASS, 1: a FAIL; JSON to $OUT or bench-out

On a lent device machine (its image has torch with CUDA, transformers, rich, safetensors):
    run(command="PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/log",
        timeout_s=540)      # --time-limit 420 s by default; the watchdog ends it by 450 s

Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0. `--allow-cpu` runs
the same steps on the CPU (smaller model and fewer tokens unless given), skipping the CUDA-only
checks: a dry run of the script itself (a minute or two on 2 cores).

Models, made with make_tiny in a temporary folder (default hidden 512, 8 layers, 32 experts, top-2):
qwen3_moe bf16; qwen3_moe FP8 (block-scaled); gpt_oss MXFP4. Loads, at half the model's bytes offloaded:
- bf16: all resident; sparse-first and declaration order with uva and prefetch; a frequency plan from a
  profiled trace (`moe_offload.measure.profile.profile`, `policy="frequency"`, `stats=traces.expert_counts`), whose
  fused expert tensors are split by any subset of experts (uva gathers host rows through the device view,
  prefetch copies rows one by one); the device-side expert cache (`cache_gb`, heat on uva, lru on prefetch);
  the disk tier (the sparse-first plan with the offloaded tensors of even layers and the embedding moved to
  disk, whole or as expert subsets; and the planner's own `host_memory_gb` placement, a quarter of the model
  in host memory, which SKIPs, naming why, while the loader refuses a tensor split across three tiers);
- FP8 and MXFP4: all resident; sparse-first with uva and prefetch (dequantized on the device after the
  gather; FP8 Linear weights per call); FP8 with a cache too.
- serve (gpu_check_serve.py, or alone with `--only serve`): the server's continuous batching on the offloaded
  model (uva, prefetch): a request alone and 8 together against generate, the meter's link bytes, decode tok/s,
  CUDA memory after the runs;
- host compute (gpu_check_host_compute.py, or alone with `--only host`): 80% of a bf16 model's expert bytes on
  the host, computed there by the CPU kernels, streamed, or as the cost model chooses; decode tok/s and link bytes
  (weights vs activations) of each against resident, tokens by the margin rule, prefill tok/s of auto against
  each forced choice, the cost model's prediction beside the measured ratio;
- grouped (gpu_check_compiled.py, last, or alone with `--only grouped`): qwen3_moe and gpt_oss bf16 with
  experts="grouped", resident / half offloaded (uva, prefetch) / every expert tensor whole on the host (uva
  reads inside the graph), eager and grouped and compiled (`mode="reduce-overhead"`: CUDA graphs): logits
  bitwise equal to the grouped resident run, compiled tokens vs uncompiled (margin rule), link bytes, decode
  tok/s of each, compile_s, and the step time against the link floor (measured pinned host->device bandwidth).
Checks (a PASS or FAIL line each; SKIP where a path is missing or needs CUDA):
- the audit is empty after load and after generate;
- placement: offloaded params lie in registered, pinned slabs (uva: CUDA views aliasing the host address;
  prefetch: host tensors); the arena holds the plan's host bytes within 1%; disk-tier params hold no memory;
- device memory: torch.cuda.memory_allocated() grows, after load and after generate, by at most what the
  plan keeps resident + the cache's carved pages + the runtime's staging buffers + a small slack;
- link bytes: a generation recorded as a trace (`profile.record`) reads, by the runtime's counters, exactly
  what `replay` of that trace says (host and disk apart; with a cache, the same hits and misses; hits > 0);
- greedy tokens (32 new) equal the all-resident run of the same checkpoint (bf16: bit for bit on the GPU;
  quantized: their own all-resident quantized run).
Then tok/s (median of 3 after a warm-up, 64 new tokens) of every load: a table (uva / prefetch / frequency /
cache / disk / quantized), also written to gpu_check_tok_s.json. Each step runs under its own time limit
(--case-limit; a step past it FAILs and the script goes on), the whole under --time-limit, and a hard
watchdog (faulthandler) ends the process if a hang in native code keeps Python from noticing; the JSON is
rewritten after every step, so even then what ran is on disk.

The pieces live beside this script: the time limits and the check rows in gpu_check_harness.py, one load and
its checks in gpu_check_load.py, the loads of each model and the token comparison in gpu_check_cases.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_check_cases import bf16_cases, compare_tokens, quant_cases
from gpu_check_compiled import compiled_section
from gpu_check_serve import serve_section
from gpu_check_host_compute import host_compute_section
from gpu_check_harness import GIB, MIB, Checks, Guard, RunTimeout, StepTimeout
from gpu_check_load import run_case

ROOT = Path(__file__).resolve().parent.parent
# Sizes of a real check (GPU) and of the CPU dry run; an option given on the command line wins over both.
GPU_SIZES = dict(hidden=512, layers=8, experts=32, check_tokens=32, bench_tokens=64, runs=3, trace_tokens=16)
CPU_SIZES = dict(hidden=64, layers=2, experts=16, check_tokens=6, bench_tokens=4, runs=1, trace_tokens=4)


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


def tok_s_table(cases: list[dict]) -> list[dict]:
    return [{"model": c["model"], "load": c["case"], "kind": c["kind"], "backend": c["backend"],
             "tok_s": c["tok_s"], "offloaded_bytes": c["offloaded_bytes"], "disk_bytes": c["disk_bytes"],
             "measured_link_bytes_per_token": c["measured_link_bytes_per_token"] + c["measured_disk_bytes_per_token"],
             "planned_link_bytes_per_token": c["planned_link_bytes_per_token"],
             "cache_hit_rate": (c["cache"]["cache_hits"] / max(1, c["cache"]["cache_hits"] + c["cache"]["cache_misses"])
                                if "cache" in c else None)}
            for c in cases]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="gpu_check: tok/s at the same offload budget (half the model)")
    cols = ("model", "load", "kind", "offloaded MiB", "disk MiB", "planned link MiB/tok", "measured link MiB/tok",
            "cache hit rate", "tok/s")
    for col in cols:
        t.add_column(col, justify="left" if col in ("model", "load", "kind") else "right")
    for r in rows:
        hit = "" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.2f}"
        t.add_row(r["model"], r["load"], r["kind"], f"{r['offloaded_bytes'] / MIB:.1f}", f"{r['disk_bytes'] / MIB:.1f}",
                  f"{r['planned_link_bytes_per_token'] / MIB:.3f}", f"{r['measured_link_bytes_per_token'] / MIB:.3f}",
                  hit, f"{r['tok_s']:.2f}")
    (Console() if sys.stdout.isatty() else Console(width=170)).print(t)


def _options(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--check-tokens", type=int)
    p.add_argument("--bench-tokens", type=int)
    p.add_argument("--trace-tokens", type=int, help="decode tokens of each recorded trace (link bytes vs replay)")
    p.add_argument("--runs", type=int)
    p.add_argument("--time-limit", type=int, default=420, help="stop (FAIL) after this many seconds in all")
    p.add_argument("--case-limit", type=int, default=90, help="FAIL a step (one load, its checks and decode) "
                                                                "past this many seconds and go on")
    p.add_argument("--only", choices=("bf16", "fp8", "mxfp4", "grouped", "serve", "host"), action="append",
                   help="models to check (default all); grouped: issue 17's grouped experts and compiled decode")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _options(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: nothing to check (gpu_check needs torch.cuda; this torch is "
              f"{torch.__version__}, cuda {torch.version.cuda})")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for k, v in (GPU_SIZES if dev.type == "cuda" else CPU_SIZES).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    models = [m for m in args.only or ["bf16", "fp8", "mxfp4"] if m not in ("grouped", "serve", "host")]

    guard = Guard(args.time_limit)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-out"
    out_dir.mkdir(parents=True, exist_ok=True)
    checks, cases, report = Checks(), [], {"machine": machine(dev), "options": vars(args), "models": {}}
    t_start = time.perf_counter()

    def write(final: bool = False) -> Path:
        """The report as it stands (after every step: a hard stop still leaves what ran)."""
        rows = [c for c in cases if "tok_s" in c]
        report.update(cases=[{k: v for k, v in c.items() if k != "prefill_logits"} for c in cases],
                      checks=checks.rows, wall_s=time.perf_counter() - t_start, finished=final,
                      passed=final and not checks.failed, tok_s=tok_s_table(rows))
        (out_dir / "gpu_check_tok_s.json").write_text(json.dumps(report["tok_s"], indent=2) + "\n")
        path = out_dir / "gpu_check.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        return path

    print(f"gpu_check on {report['machine'].get('gpu', dev)} (torch {torch.__version__}, cuda {torch.version.cuda})",
          flush=True)
    try:
        from transformers import AutoTokenizer

        import moe_offload
        from moe_offload.prompts import PROMPTS
        from moe_offload.tiny.make import make_tiny

        specs = {"bf16": dict(family="qwen3_moe", dtype="bfloat16", quant=None),
                 "fp8": dict(family="qwen3_moe", dtype="bfloat16", quant="fp8"),
                 "mxfp4": dict(family="gpt_oss", dtype="bfloat16", quant="mxfp4")}
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_s:
            tmp = Path(tmp_s)
            for key in models:
                spec = specs[key]
                try:
                    with guard.limit(f"make {key} model", args.case_limit):
                        t0 = time.perf_counter()
                        folder = make_tiny(tmp / key, hidden=args.hidden, layers=args.layers, experts=args.experts,
                                           top_k=args.top_k, **spec)
                        total = moe_offload.plan(folder, offload_gb=0).total_bytes
                except (StepTimeout, Exception) as exc:
                    traceback.print_exc()
                    checks.check(f"{key}: make_tiny {spec['family']} quant={spec['quant']}", False,
                                 f"{type(exc).__name__}: {exc}")
                    continue
                half_gb = total / 2 / GIB
                report["models"][key] = dict(spec, hidden=args.hidden, layers=args.layers, experts=args.experts,
                                             top_k=args.top_k, total_bytes=total, offload_gb=half_gb,
                                             make_s=time.perf_counter() - t0)
                print(f"model {key} ({spec['family']}, quant {spec['quant']}): {total / MIB:.1f} MiB, offload budget "
                      f"{half_gb * 1024:.1f} MiB (made in {report['models'][key]['make_s']:.0f} s)", flush=True)
                ids = AutoTokenizer.from_pretrained(folder)(PROMPTS[0], return_tensors="pt").input_ids.to(dev)
                slack = 32 * MIB
                if key == "bf16":
                    todo = bf16_cases(folder, half_gb, total, tmp, args, dev, guard, checks)
                else:
                    todo = quant_cases(half_gb, cache=key == "fp8")
                for case in todo:
                    case["model"], case["case"] = key, case["label"]
                    label = case["label"] = f"{key} {case['label']}"
                    try:
                        with guard.limit(label, args.case_limit):
                            cases.append(run_case(case, folder, ids, args, dev, checks, slack, tmp))
                    except StepTimeout as exc:
                        checks.check(f"{label}: within --case-limit {args.case_limit} s", False, str(exc))
                    except Exception as exc:  # record and go on: one run of this script should say as much as it can
                        traceback.print_exc()
                        checks.check(f"{label}: load, check and decode without error", False,
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    gc.collect()
                    write()
                compare_tokens(key, cases, args.check_tokens, checks)
                for c in cases:
                    if c["model"] == key:
                        c.pop("prefill_logits", None)
                write()
            if not args.only or "serve" in args.only:
                serve_section(tmp, args, dev, guard, checks, report, write)
            if not args.only or "host" in args.only:
                host_compute_section(tmp, args, dev, guard, checks, report, write)
            if not args.only or "grouped" in args.only:
                compiled_section(tmp, args, dev, guard, checks, report, write)
        print_table(tok_s_table(cases))
    except RunTimeout as exc:
        checks.check("gpu_check within --time-limit", False, str(exc))
    except Exception as exc:
        traceback.print_exc()
        checks.check("gpu_check ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        guard.close()
        path = write(final=True)
        print(f"wrote {path} and gpu_check_tok_s.json ({report['wall_s']:.0f} s); "
              f"{sum(r['result'] == 'PASS' for r in checks.rows)} PASS, {len(checks.failed)} FAIL, "
              f"{sum(r['result'] == 'SKIP' for r in checks.rows)} SKIP", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
