"""The peers of benchmarks/step_bench.py: llama.cpp's llama-completion and vLLM's CPU build, on the same models.

Both are found through `tools/engines.py where --json` (`make engines` installs them).

- llama.cpp: each model converted once to a bf16 GGUF (`tools/engines.py convert`, cached beside the model
  folder); decode timed by llama-completion's own `common_perf_print: eval time = X ms / N runs` (the decode
  steps after the prompt's), `-t T -tb T`, greedy (`--temp 0`), `--ignore-eos`, the prompt text (its token ids,
  read back from `--verbose-prompt`, are compared with the tokenizer's). One short warm-up run per model
  (page cache, the binary), then REPS timed runs: the median.
- vLLM: one process per model in vLLM's venv (this file run as `--vllm-job JOB OUT`; it imports nothing of the
  project), engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the CPU worker's thread binding then does
  not apply and the torch threads of this process are the engine's), `enforce_eager`, bf16, the same prompt
  token ids. vLLM replaces `torch.set_num_threads` by a no-op once its worker is up, so the real one is kept
  from before; OMP_NUM_THREADS is set to the largest thread count so the OpenMP pool can hold it. Decode tok/s
  = (N - 1) / (t(N tokens) - t(1 token)), medians of REPS generate calls each, after one warm-up of N tokens:
  the prefill cancels out. A start or a generate that fails is a row with the error, not a crash.

Both also give CPU ms per decode step (`cpu_per_token`, from the same N-token runs and as many 1-token ones:
llama.cpp's from the child's rusage, vLLM's from its process's CPU time), and `machine` describes the machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPS = 3


def cpu_per_token(cpu_n: list[float], cpu_1: list[float], tokens: int) -> float | None:
    """CPU ms per decode step: (median CPU seconds of N-token runs - of 1-token runs) / (N - 1). The load, the
    prompt and the first token cancel out; time the process waited for a core does not count, so on a shared
    machine this is what the step's work costs (at one thread; more threads add their spinning)."""
    if tokens < 2 or not cpu_n or not cpu_1:
        return None
    return (statistics.median(cpu_n) - statistics.median(cpu_1)) / (tokens - 1) * 1e3


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def engines() -> dict:
    """`tools/engines.py where --json` (always answers; "ok" per engine)."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "engines.py"), "where", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def machine(where: dict) -> dict:
    """The CPU, torch, transformers and the peers' versions, the date."""
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "llama_cpp": where["llama_cpp"].get("commit"), "vllm": where["vllm"]["version"] if where["vllm"]["ok"]
            else None, "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "tree": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                   text=True).stdout.strip() or None}


# --- llama.cpp ---------------------------------------------------------------------------------------------

def ensure_gguf(model: Path, outtype: str = "bf16") -> Path:
    """The model's GGUF (bf16, or llama.cpp's `outtype`: q8_0, ...) beside its folder, converted once."""
    gguf = model.parent / f"{model.name}.{outtype}.gguf"
    if gguf.is_file() and gguf.stat().st_mtime >= (model / "config.json").stat().st_mtime:
        return gguf
    print(f"converting {model.name} to {gguf.name} (once; cached) ...", file=sys.stderr)
    tmp = gguf.with_suffix(".gguf.tmp")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "engines.py"), "convert", str(model), str(tmp),
                          "--outtype", outtype], capture_output=True, text=True)
    if out.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"converting {model} failed (exit {out.returncode}): {out.stderr[-2000:]}")
    tmp.replace(gguf)
    return gguf


EVAL = re.compile(r"common_perf_print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")
PROMPT_TOKEN = re.compile(r"^\S+ I\s+(\d+) -> '", re.M)


def _completion(exe: str, gguf: Path, prompt: str, tokens: int, threads: int) -> tuple[float, int, list[int], float]:
    """(eval ms, eval runs, prompt token ids, CPU seconds) of one llama-completion run."""
    cmd = [exe, "-m", str(gguf), "-p", prompt, "-n", str(tokens), "--ignore-eos", "-no-cnv", "--temp", "0",
           "--seed", "0", "-t", str(threads), "-tb", str(threads), "-c", "512", "--verbose-prompt"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = out.stdout + out.stderr
    m = EVAL.search(log)
    if out.returncode != 0 or (m is None and tokens > 1):
        raise RuntimeError(f"llama-completion exit {out.returncode}, no eval time line: {log[-1500:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    ms, runs = (float(m.group(1)), int(m.group(2))) if m else (0.0, 0)
    return ms, runs, [int(t) for t in PROMPT_TOKEN.findall(log)], cpu


def llama_rows(where: dict, model: Path, label: str, prompt: str, prompt_ids: list[int], tokens: int,
               threads: list[int], outtype: str = "bf16") -> list[dict]:
    e = where["llama_cpp"]
    base = {"model": label, "arm": "llama.cpp", "engine": "llama.cpp", "tokens": tokens, "gguf_type": outtype}
    if not e["ok"]:
        return [dict(base, threads=t, error=f"llama.cpp missing: {e['missing']}") for t in threads]
    try:
        gguf = ensure_gguf(model, outtype)
        _completion(e["completion"], gguf, prompt, 8, max(threads))    # warm: page cache, binary
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return [dict(base, threads=t, error=str(err)[-800:]) for t in threads]
    rows = []
    for t in threads:
        try:
            runs = [_completion(e["completion"], gguf, prompt, tokens, t) for _ in range(REPS)]
            ones = [_completion(e["completion"], gguf, prompt, 1, t)[3] for _ in range(REPS)]
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            rows.append(dict(base, threads=t, error=str(err)[-800:]))
            continue
        per = [n / (ms / 1e3) for ms, n, _, _ in runs]
        rows.append(dict(base, threads=t, tok_s=statistics.median(per), tok_s_runs=per, decode_steps=runs[0][1],
                         cpu_ms_per_token=cpu_per_token([r[3] for r in runs], ones, tokens),
                         prompt_ids_match=runs[0][2] == prompt_ids, prompt_tokens=len(runs[0][2]),
                         build=e.get("build"), commit=e.get("commit")))
    return rows


# --- vLLM --------------------------------------------------------------------------------------------------

def vllm_rows(where: dict, model: Path, label: str, prompt_ids: list[int], tokens: int,
              threads: list[int]) -> list[dict]:
    e = where["vllm"]
    base = {"model": label, "arm": "vLLM", "engine": "vLLM", "tokens": tokens}
    if not e["ok"]:
        return [dict(base, threads=t, error=f"vLLM missing: {e['missing']}") for t in threads]
    with tempfile.TemporaryDirectory(prefix="step-bench-vllm-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"dir": str(model), "prompt_ids": prompt_ids, "tokens": tokens,
                                   "threads": threads, "reps": REPS}))
        env = {**os.environ, **e["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "OMP_NUM_THREADS": str(max(threads))}
        start = time.monotonic()
        try:
            proc = subprocess.run([e["python"], __file__, "--vllm-job", str(job), str(out)], env=env,
                                  capture_output=True, text=True, errors="replace", timeout=1800)
            tail = proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            tail = "timed out after 1800 s"
        got = json.loads(out.read_text()) if out.is_file() else {}
    wall = time.monotonic() - start
    rows = []
    for t in threads:
        r = got.get("threads", {}).get(str(t))
        err = got.get("error") or (r or {}).get("error")
        if r is None or err:
            rows.append(dict(base, threads=t, error=err or f"vLLM process gave no result: {tail}"))
            continue
        rows.append(dict(base, threads=t, **r, vllm=got.get("vllm"), load_s=got.get("load_s"),
                         process_s=round(wall, 1)))
    return rows


def _vllm_job(job_path: str, out_path: str) -> None:
    """Run in vLLM's venv: load one model, then time greedy decode at each thread count."""
    import torch

    set_threads = torch.set_num_threads   # vLLM's CPU worker replaces it with a no-op
    job = json.loads(Path(job_path).read_text())
    result: dict = {"threads": {}}

    def save():
        Path(out_path + ".tmp").write_text(json.dumps(result))
        os.replace(out_path + ".tmp", out_path)

    try:
        import vllm
        from vllm import LLM, SamplingParams

        result["vllm"] = vllm.__version__
        t0 = time.monotonic()
        llm = LLM(model=job["dir"], dtype="bfloat16", max_model_len=256, seed=0, enforce_eager=True)
        result["load_s"] = round(time.monotonic() - t0, 1)
    except Exception as e:   # noqa: BLE001  (a refused shape is a result)
        result["error"] = f"{type(e).__name__}: {e}"[-1500:]
        save()
        return
    prompt = [{"prompt_token_ids": job["prompt_ids"]}]

    def timed(n: int) -> tuple[float, list[int], float]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start, cpu = time.perf_counter(), time.process_time()
        out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        return time.perf_counter() - start, list(out.token_ids), time.process_time() - cpu

    n = job["tokens"]
    for t in job["threads"]:
        try:
            set_threads(t)
            timed(n)                                     # warm-up at this thread count
            one = [timed(1) for _ in range(job["reps"])]
            full = [timed(n) for _ in range(job["reps"])]
            t1, tn = statistics.median(r[0] for r in one), statistics.median(r[0] for r in full)
            result["threads"][str(t)] = {"tok_s": (n - 1) / (tn - t1), "t1_s": t1, "tn_s": tn,
                                         "cpu_ms_per_token": cpu_per_token([r[2] for r in full],
                                                                           [r[2] for r in one], n),
                                         "torch_threads": torch.get_num_threads(),
                                         "token_ids": full[0][1][:16], "decode_steps": n - 1}
        except Exception as e:   # noqa: BLE001
            result["threads"][str(t)] = {"error": f"{type(e).__name__}: {e}"[-1500:]}
        save()
    save()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-job":
        _vllm_job(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: step_bench_peers.py --vllm-job JOB.json OUT.json (run by step_bench.py)")
