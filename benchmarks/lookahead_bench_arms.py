"""The pieces of benchmarks/lookahead_bench.py that measure: the widened model, the prediction on the trained model,
one arm's child process (ours) and llama.cpp's run under the same limit (the memory cgroup: memory_cgroup.py).

The widened model: the trained Qwen3-MoE (models/trained-qwen3moe) with only its routed experts widened from
moe_intermediate_size 64 to FFN. Each expert keeps its trained 64 units; the added units are random (gate/up
N(0, 0.02), down N(0, DOWN_STD)), so that their contribution to the residual stream is small and the trained
routers see nearly the hidden states of the trained model on natural text: the routing keeps its skew, the
experts get the bytes of a model larger than RAM. Written in bf16, per-expert keys (Hugging Face's layout, what
convert_hf_to_gguf.py reads), one shard per layer, cached in models/ (git-ignored).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from memory_cgroup import drop_caches, run_limited   # the memory limit, and a cold page cache

ROOT = Path(__file__).resolve().parent.parent
TRAINED = ROOT / "models" / "trained-qwen3moe"
DOWN_STD = 1e-3     # the added units' down_proj: their output is ~1% of a trained expert's (measured: routing agreement)
GiB = 1 << 30


# --- the widened model ---------------------------------------------------------------------------------------

def wide_dir(ffn: int) -> Path:
    return ROOT / "models" / f"lookahead-bench-wide-{ffn}"


def ensure_wide(ffn: int, seed: int = 0) -> Path:
    out = wide_dir(ffn)
    if (out / "model.safetensors.index.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    print(f"making {out.name} (once; cached) ...", file=sys.stderr)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(TRAINED, dtype=torch.float32)
    cfg = json.loads((TRAINED / "config.json").read_text())
    f0 = cfg["moe_intermediate_size"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dense = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if ".mlp.experts." not in k
             and not (k == "lm_head.weight" and cfg.get("tie_word_embeddings"))}
    save_file(dense, tmp / "model-dense.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-dense.safetensors" for k in dense}
    for layer, block in enumerate(model.model.layers):
        ex = block.mlp.experts
        e, _, h = ex.gate_up_proj.shape
        shard, name = {}, f"model-layer{layer}.safetensors"
        for i in range(e):
            parts = {"gate_proj": (ex.gate_up_proj[i, :f0], 0.02, 0), "up_proj": (ex.gate_up_proj[i, f0:], 0.02, 0),
                     "down_proj": (ex.down_proj[i], DOWN_STD, 1)}
            for proj, (w, std, dim) in parts.items():
                shape = (ffn - f0, h) if dim == 0 else (h, ffn - f0)
                extra = torch.randn(shape, generator=gen) * std
                key = f"model.layers.{layer}.mlp.experts.{i}.{proj}.weight"
                shard[key] = torch.cat([w.detach(), extra], dim=dim).to(torch.bfloat16).contiguous()
                weight_map[key] = name
        save_file(shard, tmp / name, metadata={"format": "pt"})
    total = sum((tmp / n).stat().st_size for n in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    cfg.update(moe_intermediate_size=ffn, dtype="bfloat16")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for p in TRAINED.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "generation_config", "eval_texts")):
            shutil.copy(p, tmp / p.name)
    (tmp / "widened.json").write_text(json.dumps({"from": TRAINED.name, "trained_ffn": f0, "ffn": ffn, "seed": seed,
                                                  "gate_up_std": 0.02, "down_std": DOWN_STD}))
    tmp.replace(out)
    return out


def parallel_random_bandwidth(folder: Path, block: int, reads: int = 96, threads: int = 4, seed: int = 1) -> float:
    """O_DIRECT random reads of `block` bytes, `threads` in flight (disk_bench.disk_bandwidth: one at a time)."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(folder.glob("*.safetensors"))
    rng = random.Random(seed)
    jobs = []
    for _ in range(reads):
        f = files[rng.randrange(len(files))]
        jobs.append((f, rng.randrange(max(1, (f.stat().st_size - block) // 4096)) * 4096))

    def worker(part):
        buf = mmap.mmap(-1, block)
        fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
        try:
            return sum(os.preadv(fds[f], [buf], off) for f, off in part)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(worker, [jobs[i::threads] for i in range(threads)]))
    return total / (time.perf_counter() - start)


def cold_bandwidth(folder: Path, block: int, seq_bytes: int) -> dict:
    """disk_bench.disk_bandwidth of the checkpoint's files from a cold page cache (sequential; random reads of `block`
    bytes one at a time), with the random reads four in flight beside it."""
    from disk_bench import disk_bandwidth

    drop_caches()
    b = disk_bandwidth(folder, seq_bytes=seq_bytes, rand_block=block)
    b["random_4_in_flight_bytes_per_s"] = parallel_random_bandwidth(folder, block)
    return b


# --- 1. prediction on the trained model ------------------------------------------------------------------------

def routing_and_hidden(model, ids: list[int], prefill: int, steps: int) -> list[dict]:
    """Per decode step: the runtime's routing (layer -> expert ids) and each decoder layer's output hidden state."""
    import torch

    from moe_offload.measure.timing import _forward_keywords
    from moe_offload.model.inventory import layer_of, layer_prefix

    rt = model.moe_offload_runtime
    hidden, pre, calls, handles = {}, {}, [], []
    for name, mod in model.named_modules():
        if layer_prefix(name) == name:
            layer = layer_of(name)
            handles.append(mod.register_forward_hook(lambda m, a, out, layer=layer: hidden.__setitem__(
                layer, (out[0] if isinstance(out, tuple) else out).detach().clone())))
            # the residual stream after this layer's attention, before its MoE: a prediction made here overlaps
            # the whole of this layer's experts (a wider window than its output's)
            handles.append(mod.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, layer=layer: pre.__setitem__(layer, a[0].detach().clone())))
    rt.recorder = lambda call: calls.append({"routed": {k: set(v.flatten().tolist()) for k, v in call.experts.items()},
                                             "hidden": dict(hidden), "pre": dict(pre)})
    cache_kw, _, _ = _forward_keywords(model)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=x[:, :prefill], use_cache=True)
        for i in range(min(steps, len(ids) - prefill)):
            out = model(input_ids=x[:, prefill + i:prefill + i + 1], use_cache=True, **{cache_kw: getattr(out, cache_kw)})
    for h in handles:
        h.remove()
    rt.recorder = None
    return calls[1:]


def prediction(cfg: dict, arm_ids: list[int]) -> dict:
    import torch

    from moe_offload.loading.loader import load, load_tokenizer
    from moe_offload.run.lookahead import RouterPredictor

    torch.set_num_threads(1)
    model, _ = load(TRAINED, device="cpu", offload_gb=0)
    tok = load_tokenizer(TRAINED)
    texts = json.loads((TRAINED / "eval_texts.json").read_text())
    n = cfg["texts"]
    chosen = [("heldout_prose", t) for t in texts["heldout_prose"][:n]] + [("heldout_code", t) for t in texts["heldout_code"][:n]]
    predictor = RouterPredictor(model)
    layers = model.config.num_hidden_layers
    experts = model.config.num_experts
    counts = {t: {"tp": 0, "pred": 0, "actual": 0} for t in range(layers)}
    variants = {"n2": {t: [0, 0] for t in range(layers)}, "pre": {t: [0, 0] for t in range(layers)}}  # [right, picked]
    picks = {t: [0] * experts for t in range(layers)}
    steps_seen = 0
    for kind, text in chosen:
        ids = tok(text)["input_ids"]
        for call in routing_and_hidden(model, ids, cfg["prefill"], cfg["pred_steps"]):
            steps_seen += 1
            for t in range(layers):
                actual = call["routed"][t]
                counts[t]["actual"] += len(actual)
                for e in actual:
                    picks[t][e] += 1
                if t == 0:
                    continue            # N = 1: layer 0 has no layer before it
                for v, h in (("n2", call["hidden"].get(t - 2)), ("pre", call["pre"][t - 1])):
                    if h is not None:
                        variants[v][t][0] += len(set(predictor.predict(t, h) or []) & actual)
                        variants[v][t][1] += len(actual)
                pred = set(predictor.predict(t, call["hidden"][t - 1]) or [])
                counts[t]["pred"] += len(pred)
                counts[t]["tp"] += len(pred & actual)
    arm_routing = [{t: sorted(c["routed"][t]) for t in range(layers)}
                   for c in routing_and_hidden(model, arm_ids, cfg["prefill"], cfg["steps"])]
    per_layer = {}
    for t, c in counts.items():
        per_layer[t] = {"recall": c["tp"] / c["actual"] if t and c["actual"] else None,
                        "precision": c["tp"] / c["pred"] if t and c["pred"] else None,
                        "picked": c["actual"], "predicted": c["pred"], "right": c["tp"], "skew_top10": skew(picks[t]),
                        **{f"recall_{v}": (vc[t][0] / vc[t][1] if vc[t][1] else None) for v, vc in variants.items()}}
    needed = sum(c["actual"] for c in counts.values())
    right = sum(c["tp"] for c in counts.values())
    wasted = sum(c["pred"] - c["tp"] for c in counts.values())
    return {"texts": [k for k, _ in chosen], "decode_steps": steps_seen,
            "per_layer": per_layer, "read_ahead_share": right / needed, "wasted_share": wasted / needed,
            "read_ahead_share_layers_1_on": right / sum(c["actual"] for t, c in counts.items() if t),
            "arm_text_routing": arm_routing}


def skew(picks: list[int]) -> float:
    """Share of the picks taken by the busiest 10% of experts, rounded up (4 of 32: uniform routing gives 12.5%)."""
    top = max(1, math.ceil(len(picks) / 10))
    return sum(sorted(picks, reverse=True)[:top]) / max(1, sum(picks))


# --- one arm of ours, in its own process ------------------------------------------------------------------------

def child(spec: dict) -> dict:
    """One arm: load the model as spec says, prefill spec['prefill'] tokens, then one timed decode step per token
    (the forward's time, as llama.cpp's eval time counts its decode; choosing the next token, which llama.cpp counts
    apart as its sampling time, in choose_ms_per_token. spec['greedy']: each step's input is the token the step
    before chose, else the text's next; spec['sample'] {temperature, seed}: the token the step before drew from its
    softmax at that temperature, as llama.cpp's `--temp T --top-k 0 --top-p 1 --min-p 0` draws; spec['experts']:
    how the experts are computed, load's default when absent). spec['compile']: the decode steps through the
    compiled step (run/compiled.py, a static KV cache, as `--compile` decodes): one decode step more, the first,
    which compiles; its time beyond the median step is compile_s (compiled.compile_seconds), and the
    spec['steps'] after it are measured."""
    import torch

    torch.set_num_threads(spec["threads"])
    from disk_bench import _io_read_bytes, disk_plan
    from moe_offload.loading.loader import load
    from moe_offload.measure.timing import _forward_keywords, peak_rss_bytes, reset_peak_rss
    from moe_offload.run.host_cache import host_cache_stats
    from moe_offload.run.lookahead import lookahead_stats
    from moe_offload.run import experts, lookahead, read_executor, streamed
    import transformers  # noqa: F401  (imported before the peak is reset)

    # Where a step's time goes (wrapped here, in this process only): the critical path's expert staging (reads,
    # host-cache copies; look-ahead takes included) and the look-ahead's takes (waits for reads under way).
    timers = {"stage": 0.0, "take": 0.0}

    def timed(cls, name, key):
        f = getattr(cls, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
        setattr(cls, name, wrapper)

    timed(experts, "execute", "stage")   # the read plans carried out (experts.py calls read_executor.execute)
    timed(streamed, "execute_sides", "stage")       # a streamed CPU decode step's: hits and resident rows placed,
    timed(read_executor.Deferred, "wait", "stage")  # then each queued read waited for before its expert is computed
    timed(lookahead.AheadRows, "wait", "take")
    folder = Path(spec["model"])
    ids = torch.tensor([spec["ids"]])
    reset_peak_rss()
    base = peak_rss_bytes()
    t0 = time.perf_counter()
    if spec["arm"] == "resident":
        model, plan = load(folder, device="cpu", offload_gb=0, experts=spec.get("experts"))
    else:
        plan = disk_plan(folder, spec["budget_gb"], spec["reserve_gb"], spec.get("stats"))
        model, plan = load(folder, device="cpu", plan=plan, host_cache_gb=spec.get("host_cache_gb"),
                           lookahead=spec.get("lookahead", 0), lookahead_from=spec.get("lookahead_from", "output"),
                           disk_read=spec.get("disk_read", "direct"), experts=spec.get("experts"))
    load_s = time.perf_counter() - t0
    rt = model.moe_offload_runtime
    routed = []
    rt.recorder = lambda call: routed.append({k: v.flatten().tolist() for k, v in call.experts.items()})
    cache_kw, _, takes_keep = _forward_keywords(model)
    extra = {"logits_to_keep": 1} if takes_keep else {}
    p, steps = spec["prefill"], spec["steps"]
    itl, pick, disk, io, argmax = [], [], [], [], []
    sample = spec.get("sample")
    draw = torch.Generator().manual_seed(sample["seed"]) if sample else None

    def choose(logits) -> int:     # greedy, or drawn from the softmax at the temperature
        if draw is None:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits.float() / sample["temperature"], -1), 1, generator=draw))

    compiled = bool(spec.get("compile"))
    call, static, warm = model, {}, 0
    if compiled:
        from transformers import StaticCache
        from moe_offload.run.compiled import check_compile, compile_config, compile_seconds, decoding

        check_compile(model)
        import torch._inductor.config as inductor

        inductor.compile_threads = 1    # no compile workers: their memory would be charged to the arm's cgroup
        static = {cache_kw: StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=p + steps + 2)}
        call, warm = model.get_compiled_call(compile_config(torch.device("cpu"))), 1
    with torch.no_grad(), (decoding(model) if compiled else contextlib.nullcontext()):
        t = time.perf_counter()
        out = model(input_ids=ids[:, :p], use_cache=True, **static, **extra)
        ttft = time.perf_counter() - t
        first = choose(out.logits[0, -1])
        cache = getattr(out, cache_kw)
        timers.update(stage=0.0, take=0.0)
        for i in range(steps + warm):
            if i == warm and warm:      # the compiling step is not measured: the counters restart after it
                first_s = itl.pop()
                pick.clear(), disk.clear(), io.clear()
                timers.update(stage=0.0, take=0.0)
            before = _io_read_bytes()
            t = time.perf_counter()
            # greedy or sampled: the token the model chose (as llama.cpp decodes), else the text's next token
            own = spec.get("greedy") or sample
            x = torch.tensor([[argmax[-1] if argmax else first]]) if own else ids[:, p + i:p + i + 1]
            out = call(input_ids=x, use_cache=True, **{cache_kw: cache}, **extra)
            itl.append(time.perf_counter() - t)
            t = time.perf_counter()
            argmax.append(choose(out.logits[0, -1]))
            pick.append(time.perf_counter() - t)
            io.append(_io_read_bytes() - before)
            disk.append(rt.disk_counter.calls[-1][1])
            cache = getattr(out, cache_kw)
    peak = peak_rss_bytes()
    decode_routed = routed[1 + warm:]   # the prefill's call first (then the compiling step's)
    compile_s = compile_seconds([first_s, *itl]) if warm else 0.0
    row = {"arm": spec["label"], "key": spec["key"], "steps": steps, "load_s": load_s, "ttft_s": ttft,
           "itl_s": itl, "tok_s_mean": steps / sum(itl), "tok_s_p50": 1 / statistics.median(itl),
           "choose_ms_per_token": statistics.mean(pick) * 1e3,
           "disk_counted_bytes_per_token": statistics.mean(disk), "proc_io_read_bytes_per_token": statistics.mean(io),
           "peak_rss_bytes": peak, "baseline_rss_bytes": base, "argmax": argmax, "routed": decode_routed,
           "resident_bytes": plan.resident_bytes,
           "disk_tier_bytes": sum(t.offloaded_bytes for t in plan.tensors if t.tier == "disk"),
           "stage_ms_per_token": timers["stage"] / steps * 1e3, "lookahead_take_ms_per_token": timers["take"] / steps * 1e3,
           "compiled": compiled, "compile_s": compile_s,
           "mechanism": rt.mechanism, "plan_notes": list(getattr(plan, "notes", []) or []),
           **host_cache_stats(getattr(rt, "host_cache", None)), **lookahead_stats(getattr(rt, "lookahead", None), steps)}
    if getattr(rt, "lookahead", None) is not None:
        rt.lookahead.close()
    return row


def run_ours(spec: dict, limit_bytes: int | None, logdir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lookahead_bench.py"), "--child", json.dumps(spec)]
    res = run_limited(cmd, limit_bytes, spec["key"], logdir / f"{spec['key']}.out")
    lines = [ln for ln in res.pop("stdout").splitlines() if ln.startswith("{")]
    if res["rc"] != 0 or not lines:
        return {"arm": spec["label"], "key": spec["key"], "error": f"exit {res['rc']}", **res}
    res.pop("stderr_tail")
    return {**json.loads(lines[-1]), **res}


# --- llama.cpp, memory-mapped, under the same limit --------------------------------------------------------------

def run_llama(model: Path, prompt: str, steps: int, limit_bytes: int, logdir: Path, threads: int,
              sampling: tuple[str, ...] = ("--temp", "0"), tag: str = "", extra: tuple[str, ...] = ()) -> dict:
    """llama-completion on the model's bf16 GGUF (convert_hf_to_gguf.py via tools/engines.py), mmap'd (its default),
    cold page cache, in the cgroup; run once for 1 token and once for steps + 1, so that the difference of their
    read bytes over steps is what decoding reads per token (the load and prefill cancel). `sampling`: its sampler
    options (greedy by default); `extra`: more options (--no-repack)."""
    from step_bench_peers import EVAL, engines, ensure_gguf

    where = engines()["llama_cpp"]
    base = {"arm": "(e) llama.cpp mmap", "key": "llama"}
    if not where["ok"]:
        return {**base, "error": f"llama.cpp missing: {where['missing']}"}
    gguf = ensure_gguf(model)
    runs = {}
    for n in (1, steps + 1):
        cmd = [where["completion"], "-m", str(gguf), "-p", prompt, "-n", str(n), "--ignore-eos", "-no-cnv",
               *sampling, *extra, "--seed", "0", "-t", str(threads), "-tb", str(threads), "-c", "512"]
        name = f"llama{tag}-{n}"
        res = run_limited(cmd, limit_bytes, name, logdir / f"{name}.out")
        log = res["stdout"] + (logdir / f"{name}.err").read_text()
        m = EVAL.search(log)
        if res["rc"] != 0 or (n > 1 and m is None):
            return {**base, "error": f"llama-completion -n {n}: exit {res['rc']}", "log_tail": log[-1500:],
                    **{k: v for k, v in res.items() if k != "stdout"}}
        res.pop("stdout")
        res["eval_ms"], res["eval_runs"] = (float(m.group(1)), int(m.group(2))) if m else (0.0, 0)
        runs[n] = res
    long = runs[steps + 1]
    per_token = (long["child_read_bytes"] - runs[1]["child_read_bytes"]) / steps
    return {**base, **{k: v for k, v in long.items() if k.startswith("cgroup_") or k == "wall_s"},
            "steps": long["eval_runs"], "tok_s_mean": long["eval_runs"] / (long["eval_ms"] / 1e3), "tok_s_p50": None,
            "proc_io_read_bytes_per_token": max(per_token, 0.0), "disk_counted_bytes_per_token": None,
            "peak_rss_bytes": long["child_maxrss_bytes"], "read_bytes_runs": [runs[1]["child_read_bytes"],
            long["child_read_bytes"]], "gguf": gguf.name, "mechanism": "llama.cpp's default mmap of the GGUF"}
