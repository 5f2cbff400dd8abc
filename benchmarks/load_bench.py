"""Load time, peak host memory and decode overhead: transformers vs moe_offload.load.

    .venv/bin/python benchmarks/load_bench.py [--size-gb 2] [--out bench-out/load_bench.json]

Makes (once, cached under bench-out/load-model-<size>) a random-weight Qwen3-MoE checkpoint
of about --size-gb GiB in bfloat16 with `moe_offload.tiny.make.make_tiny`, then runs each method
in a fresh subprocess, so that every peak-RSS figure belongs to one method alone:

- `hf`: `AutoModelForCausalLM.from_pretrained(dir, experts_implementation="eager")`;
- `mo-resident-{uva,prefetch}`: `moe_offload.load(dir, offload_gb=0)`: nothing offloaded,
  so decode speed against `hf` is the overhead of our hooks and experts function;
- `mo-offload-{uva,prefetch}`: `moe_offload.load(dir, offload_gb=<half the model>)`.

Each child first loads a tiny model of the same family (imports and other one-time costs,
reported as first_call_overhead_s), then loads the real one (timed; peak RSS = VmHWM right
after the load, before any decoding; peak anon = RssAnon sampled every 5 ms, which leaves
out the checkpoint's memory-mapped file pages), then decodes greedily: a warm-up, then
`--runs` timed runs of exactly `--new-tokens` tokens (min_new_tokens = max_new_tokens, so
EOS never stops early); tok/s is new tokens / wall seconds of `generate` (prefill of the
short prompt included) and the median is reported.

On a machine without an accelerator the host tier is ordinary memory: the offloaded case
then measures the cost of our staging/indexing logic, not a link. Link bytes per token
are the runtime's own count of bytes read from the host tier (never derived from model size).
Children run torch with --threads threads (default 1: on a small shared machine OpenMP
barriers of oversubscribed threads make timings swing by 10x); CPU seconds are reported
next to wall seconds, and the 1-minute load average before/after each child.
Before every child the checkpoint is read once, so all methods see a warm page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2 ** 30
ROOT = Path(__file__).resolve().parent.parent
METHODS = ("hf", "mo-resident-uva", "mo-resident-prefetch", "mo-offload-uva", "mo-offload-prefetch")


# --- the model ------------------------------------------------------------------------------

def _qwen3_moe_bytes(hidden: int, layers: int, experts: int, vocab: int = 512, itemsize: int = 2) -> int:
    """Bytes of make_tiny's qwen3_moe (4 heads, 2 KV heads, expert FFN 1.5*hidden, untied embeddings)."""
    h, hd = hidden, hidden // 4
    attn = h * h + 2 * (h * h // 2) + h * h + 2 * hd       # q, k, v, o; q_norm, k_norm
    moe = experts * h + experts * (3 * h * h) + experts * (h * 3 * h // 2)  # router; gate_up [E,2I,H]; down [E,H,I]
    per_layer = attn + moe + 2 * h                          # + two RMSNorms
    return itemsize * (layers * per_layer + 2 * vocab * h + h)


def choose_shape(size_gb: float) -> dict:
    """hidden/layers/experts of a qwen3_moe of about size_gb GiB: the widest model with at least 2 layers."""
    target = size_gb * GIB
    for hidden in (1024, 512, 256, 128):
        for experts in (32, 16, 8):
            per_layer = _qwen3_moe_bytes(hidden, 1, experts) - _qwen3_moe_bytes(hidden, 0, experts)
            layers = max(1, round((target - _qwen3_moe_bytes(hidden, 0, experts)) / per_layer))
            if layers >= 2:
                return dict(hidden=hidden, layers=layers, experts=experts, top_k=4)
    return dict(hidden=64, layers=2, experts=8, top_k=2)


def ensure_model(size_gb: float | None, cache: Path) -> tuple[Path, dict]:
    """The cached checkpoint of about size_gb GiB (None: the tiny warm-up model), made on first use."""
    from moe_offload.tiny.make import make_tiny

    if size_gb is None:
        folder, shape = cache / "load-model-warmup", dict(hidden=64, layers=2, experts=4, top_k=2)
    else:
        folder, shape = cache / f"load-model-{size_gb:g}gb", choose_shape(size_gb)
    if not (folder / "moe_offload_tiny.json").is_file():
        t0 = time.perf_counter()
        what = "a tiny warm-up" if size_gb is None else f"a {size_gb:g} GiB"
        print(f"making {what} qwen3_moe checkpoint in {folder} ({shape}); done once, then cached",
              file=sys.stderr)
        make_tiny(folder, family="qwen3_moe", dtype="bfloat16", **shape)
        print(f"  made in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return folder, json.loads((folder / "moe_offload_tiny.json").read_text())


def warm_page_cache(folder: Path) -> None:
    """Read every weight file once, so no method pays (or gains from) a cold page cache."""
    buf = bytearray(64 << 20)
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# --- one method, in a child process ------------------------------------------------------------

def _proc_status() -> dict[str, int]:
    """VmHWM (peak RSS), VmRSS, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _AnonPeak:
    """Samples RssAnon every few ms in a thread: the peak of private memory, which VmHWM mixes with mapped file pages."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _proc_status()["RssAnon"])
            self._stop.wait(interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _proc_status()["RssAnon"])


def _load(method: str, model_dir: Path, offload_gb: float):
    import torch
    from transformers import AutoModelForCausalLM

    import moe_offload

    if method == "hf":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, experts_implementation="eager")
        return model.eval(), None
    _, placement, backend = method.split("-")
    return moe_offload.load(model_dir, offload_gb=offload_gb if placement == "offload" else 0, backend=backend,
                            device="cpu")


def run_child(method: str, model_dir: Path, warmup_dir: Path, offload_gb: float, new_tokens: int, runs: int,
              threads: int) -> dict:
    import resource

    import torch
    from transformers import AutoTokenizer

    import moe_offload
    from moe_offload.prompts import PROMPTS

    torch.set_num_threads(threads)
    load_avg = [os.getloadavg()[0]]
    # One-time costs (transformers' lazy imports, torch._dynamo, ...) are seconds and would dominate a small
    # model's load: pay them on a throwaway model of the same family first, and report them apart.
    t0 = time.perf_counter()
    warm, _ = _load(method, warmup_dir, 0.0)
    if hasattr(warm, "moe_offload_runtime"):
        warm.moe_offload_runtime.arena.release()
    del warm
    first_call_s = time.perf_counter() - t0

    before = _proc_status()
    t0, c0 = time.perf_counter(), time.process_time()
    with _AnonPeak() as anon:
        model, plan = _load(method, model_dir, offload_gb)
    runtime = getattr(model, "moe_offload_runtime", None)
    load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    after = _proc_status()
    result = {
        "method": method,
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
        "first_call_overhead_s": first_call_s,
        "peak_rss_bytes": after["VmHWM"],                 # includes file pages mapped while loading
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_anon_bytes": anon.peak,                     # sampled every 5 ms: private memory only
        "rss_before_load_bytes": before["VmRSS"],
        "rss_anon_before_load_bytes": before["RssAnon"],
        "rss_after_load_bytes": after["VmRSS"],
        "rss_anon_after_load_bytes": after["RssAnon"],
        "rss_file_after_load_bytes": after["RssFile"],
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "torch_threads": torch.get_num_threads(),
    }
    if plan is not None:
        result.update(backend=runtime.backend, mechanism=runtime.mechanism, arena_mechanism=runtime.arena.mechanism,
                      offload_gb=offload_gb if "offload" in method else 0.0,
                      offloaded_bytes=plan.offloaded_bytes, resident_bytes=plan.resident_bytes,
                      total_bytes=plan.total_bytes, host_arena_bytes=runtime.host_bytes,
                      audit=[str(m) for m in moe_offload.audit(model, plan)])

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(ids, **gen)                            # warm-up
    times, cpu, out = [], [], None
    if runtime is not None:
        runtime.counter.reset()
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate(ids, **gen)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == new_tokens, f"generated {len(new)} tokens, asked for {new_tokens}"
    load_avg.append(os.getloadavg()[0])
    result.update(prompt_tokens=int(ids.shape[1]), new_tokens=new_tokens, decode_s=times, decode_cpu_s=cpu,
                  tok_s=new_tokens / statistics.median(times), cpu_ms_per_token=1e3 * statistics.median(cpu) / new_tokens,
                  tokens=new, load_average_1min=load_avg)
    if runtime is not None:
        result["link_bytes_per_token"] = runtime.counter.decode_bytes_per_token()
    return result


# --- the parent ---------------------------------------------------------------------------------

def machine() -> dict:
    import torch
    import transformers

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "memory_bytes": mem, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerator": (torch.accelerator.current_accelerator().type
                            if getattr(torch, "accelerator", None) and torch.accelerator.is_available() else None)}


def spawn(method: str, model_dir: Path, offload_gb: float, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = Path(tmp.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--model", str(model_dir),
           "--warmup-model", str(args.warmup_model), "--offload-gb", repr(offload_gb),
           "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--threads", str(args.threads),
           "--child-out", str(out)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.child_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    result["child_wall_s"] = time.perf_counter() - t0
    return result


def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def print_tables(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console() if sys.stdout.isatty() else Console(width=150)
    m = report["machine"]
    con.print(f"[bold]machine[/]: {m['platform']}, {m['cpu']}, {m['cpu_count']} CPUs, "
              f"{_gib(m['memory_bytes'])} GiB RAM, torch {m['torch']}, transformers {m['transformers']}, "
              f"accelerator {m['accelerator']}")
    mod = report["model"]
    con.print(f"[bold]model[/]: {mod['dir']} qwen3_moe hidden {mod['hidden']}, {mod['layers']} layers, "
              f"{mod['experts']} experts (top-{mod['top_k']}), bf16, {_gib(mod['total_bytes'])} GiB")
    hf = report["results"]["hf"]
    t = Table(title="load (each in a fresh process; warm page cache)")
    for col in ("method", "load s", "load CPU s", "peak RSS GiB", "peak anon GiB", "anon growth GiB",
                "offloaded GiB", "host arena GiB", "arena / offloaded"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, r in report["results"].items():
        off, arena = r.get("offloaded_bytes"), r.get("host_arena_bytes")
        ratio = f"{arena / off:.5f}" if off else "-"
        t.add_row(name, f"{r['load_s']:.2f}", f"{r['load_cpu_s']:.2f}", _gib(r["peak_rss_bytes"]),
                  _gib(r["peak_anon_bytes"]), _gib(r["rss_anon_after_load_bytes"] - r["rss_anon_before_load_bytes"]),
                  _gib(off), _gib(arena), ratio)
    con.print(t)
    t = Table(title=f"greedy decode: {report['new_tokens']} new tokens, median of {report['runs']} after a warm-up")
    for col in ("method", "offloaded GiB", "tok/s", "vs hf", "CPU ms/token", "link MiB/token", "tokens == hf",
                "load avg"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, r in report["results"].items():
        link = r.get("link_bytes_per_token")
        t.add_row(name, _gib(r.get("offloaded_bytes")), f"{r['tok_s']:.2f}", f"{r['tok_s'] / hf['tok_s']:.3f}",
                  f"{r['cpu_ms_per_token']:.1f}", "-" if link is None else f"{link / 2**20:.2f}",
                  str(r["tokens"] == hf["tokens"]), " / ".join(f"{x:.1f}" for x in r["load_average_1min"]))
    con.print(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GiB (default 2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-out" / "load_bench.json")
    p.add_argument("--cache", type=Path, default=ROOT / "bench-out", help="where the checkpoint is made and kept")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per child (default 1: on a small shared machine, OpenMP barriers of "
                        "oversubscribed threads make timings swing by 10x)")
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--warmup-model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--offload-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        result = run_child(args.child, args.model, args.warmup_model, args.offload_gb, args.new_tokens, args.runs,
                           args.threads)
        args.child_out.write_text(json.dumps(result))
        return 0

    t_start = time.perf_counter()
    import moe_offload

    model_dir, made = ensure_model(args.size_gb, args.cache)
    args.warmup_model, _ = ensure_model(None, args.cache)
    total = moe_offload.plan(model_dir, offload_gb=0).total_bytes
    offload_gb = total / 2 / GIB
    results = {}
    for method in args.methods:
        warm_page_cache(model_dir)
        print(f"running {method} ...", file=sys.stderr)
        results[method] = spawn(method, model_dir, offload_gb, args)
    report = {
        "machine": machine(),
        "model": dict(dir=str(model_dir), total_bytes=total, **{k: made[k] for k in ("hidden", "layers", "experts",
                                                                                      "top_k", "dtype")}),
        "offload_gb_half": offload_gb,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "torch_threads": args.threads,
        "tok_s_definition": "new tokens / wall seconds of model.generate (short prompt's prefill included), "
                            "median of runs after one warm-up",
        "load_definition": "wall seconds of the load call in a fresh process, after the same call on a tiny "
                           "model of the same family (first_call_overhead_s: imports and other one-time costs)",
        "peak_rss_definition": "VmHWM of the child process right after loading (file-backed pages of the "
                               "memory-mapped checkpoint count while mapped); peak anon: RssAnon sampled every 5 ms "
                               "during the load (private memory only); anon growth: RssAnon after - before the load",
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }
    if "hf" in results:
        print_tables(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
