"""The servers and the client of benchmarks/serve_bench.py: each server a subprocess on a free port, driven by
the same streaming `openai` client code, plus the runtime's own references (bench, generate).

- Servers: `moe-offload serve` (ours, under the budget), `transformers serve` (the same .venv, nothing offloaded,
  its continuous batching), vLLM's CPU build (`python -m vllm.entrypoints.openai.api_server` in its own venv,
  from `tools/engines.py where --json`). Each is its own process group (start_new_session), started, waited
  for (GET /health, then /v1/models), and stopped with SIGTERM to that group (SIGKILL after a grace period);
  its log goes to a file. Threads: OMP_NUM_THREADS=T for all three (ours has no --threads and sets none: torch
  takes OMP_NUM_THREADS at start; vLLM's CPU worker is told VLLM_CPU_OMP_THREADS_BIND=nobind so that it keeps
  the variable instead of binding its own cores).
- One round: c client threads, each with its own `openai.OpenAI` client (max_retries=0: a failure is counted, not
  retried), released together by a barrier; each streams one completion (greedy, max_tokens fixed, EOS ignored
  through each server's own way of saying so) and notes the arrival time of every chunk.
- References: `moe-offload bench --arms sparse-first --concurrency 1,C` (its JSON rows) and the generate path
  (`model.generate`, timed token by token by moe_offload.measure.timing.greedy_generate) in a child process.
"""

from __future__ import annotations

import json
import os
import statistics
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"


def free_port() -> int:
    """A port the kernel calls free now (bound to 0, then released for the server to take)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except Exception as e:   # noqa: BLE001  (not up yet)
        return 0, str(e)


# --- prompts, models ---------------------------------------------------------------------------------------------

NAMES = ("read_config", "parse_header", "open_socket", "format_date", "merge_paths", "split_words", "load_module",
         "close_stream", "count_lines", "find_entry", "quote_string", "check_access", "build_index")
DOCS = ("return the settings of the file as a dict", "raise ValueError when the input is empty",
        "yield each item with its position", "write the result to the given stream")


def prompt_pool(n: int) -> list[str]:
    """n distinct one-line prompts (one line each: bench --prompts takes one prompt per line)."""
    out = [f"def {name}(self, value, default=None):  # {doc}, then"
           for doc in DOCS for name in NAMES]
    if n > len(out):
        raise SystemExit(f"{n} prompts wanted, {len(out)} in the pool")
    return out[:n]


def schedule(rounds: int, levels: tuple[int, ...]) -> dict[tuple[int, int], list[int]]:
    """(clients, round) -> the prompt indices of that round (round 0 is the warm-up): all distinct."""
    out, at = {}, 0
    for c in levels:
        for r in range(rounds + 1):
            out[(c, r)] = list(range(at, at + c))
            at += c
    return out


def head_dim(folder: Path) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def context_of(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings") or 2048)


# --- servers --------------------------------------------------------------------------------------------------

@dataclass
class ServerSpec:
    """How to start one peer, and what its requests need to decode to max_tokens whatever EOS says."""

    name: str                   # ours / transformers / vLLM
    mode: str                   # in words, for the report
    cmd: list[str]
    env: dict
    extra_body: dict
    start_timeout: float = 240.0


def ours_spec(model: Path, port: int, threads: int, offload_gb: float, max_len: int) -> ServerSpec:
    cmd = [str(BIN / "moe-offload"), "serve", str(model), "--offload-gb", f"{offload_gb:.6f}", "--port", str(port),
           "--max-model-len", str(max_len), "--max-concurrency", "8", "--shutdown-timeout", "5"]
    return ServerSpec("moe-offload serve", f"continuous batching (transformers' manager), uva, eager experts, "
                      f"--offload-gb {offload_gb:.4g}", cmd, _threads_env(threads), {"ignore_eos": True}, 120)


def transformers_spec(model: Path, port: int, threads: int) -> ServerSpec:
    cmd = [str(BIN / "transformers"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--continuous-batching", "--device", "cpu", "--log-level", "warning"]
    # It refuses `ignore_eos`; its `generation_config` field (a JSON string) sets eos_token_id [] instead.
    gen = json.dumps({"eos_token_id": [], "do_sample": False})
    return ServerSpec("transformers serve", "--continuous-batching (paged attention), nothing offloaded", cmd,
                      _threads_env(threads), {"generation_config": gen}, 180)


def vllm_spec(where: dict, model: Path, port: int, threads: int, max_len: int) -> ServerSpec:
    e = where["vllm"]
    cmd = [e["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_len), "--enforce-eager",
           "--seed", "0", "--no-enable-prefix-caching", "--disable-log-stats"]
    env = {**_threads_env(threads), **e["env"], "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return ServerSpec("vLLM", f"vLLM {e['version']} CPU, enforce_eager, bf16, prefix caching off, nothing offloaded",
                      cmd, env, {"ignore_eos": True}, 300)


def _threads_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


class Server:
    """A peer's process while the `with` lasts: started, waited for, stopped; `url` its /v1 base."""

    def __init__(self, spec: ServerSpec, port: int, log: Path):
        self.spec, self.port, self.log_path = spec, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start_s = self.exit_code = None
        self.model_id = ""

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        began = time.monotonic()
        self.proc = subprocess.Popen(self.spec.cmd, env=self.spec.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        while time.monotonic() - began < self.spec.start_timeout:
            if self.proc.poll() is not None:
                self._close()
                raise RuntimeError(f"{self.spec.name} exited {self.proc.returncode} before serving: {self.tail()}")
            status, _ = _get(self.base + "/health", 2)
            if status == 200:
                status, body = _get(self.base + "/v1/models", 5)
                if status == 200:
                    self.model_id = json.loads(body)["data"][0]["id"]
                    self.start_s = time.monotonic() - began
                    return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.spec.name} did not answer /health within {self.spec.start_timeout:.0f} s: "
                           f"{self.tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)     # the group this Popen made: the server and its workers
            try:
                self.exit_code = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.exit_code = self.proc.wait()
        elif self.proc is not None:
            self.exit_code = self.proc.returncode
        if self.proc is not None:
            try:   # workers left in the group after the leader went (vLLM's engine core)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._close()

    def _close(self) -> None:
        if not self.log.closed:
            self.log.close()

    def tail(self, n: int = 1200) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Our /metrics, the moe_offload_* samples (name{labels} -> value)."""
        status, body = _get(self.base + "/metrics", 10)
        out = {}
        for line in body.splitlines() if status == 200 else []:
            if line.startswith("moe_offload_") and " " in line:
                key, value = line.rsplit(" ", 1)
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out


# --- the client ----------------------------------------------------------------------------------------------

@dataclass
class Request:
    prompt: int                                        # index into the prompt pool
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text (perf_counter)
    last: float = 0.0                                  # arrival of the last chunk carrying a choice
    text: str = ""
    completion_tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    round_cpu_s: float = 0.0     # CPU seconds of this client process over the whole round (all its clients)

    def ok(self, max_tokens: int) -> bool:
        return self.error is None and self.finish == "length" and self.completion_tokens == max_tokens


def _stream_one(client, model_id: str, prompt: str, max_tokens: int, extra: dict, req: Request,
                barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=60)
        req.sent = time.perf_counter()
        stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra)
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                req.last = now
                if choice.text:
                    req.chunks.append(now)
                    req.text += choice.text
                if choice.finish_reason:
                    req.finish = choice.finish_reason
            if chunk.usage is not None:
                req.completion_tokens = chunk.usage.completion_tokens
    except Exception as e:   # noqa: BLE001  (a lost request is a result)
        req.error = f"{type(e).__name__}: {e}"[:500]


def client_round(base: str, model_id: str, prompts: list[str], pool_index: list[int], max_tokens: int,
                 extra: dict) -> list[Request]:
    """len(prompts) concurrent streaming completions, released together; every request's timings."""
    import openai

    clients = [openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300) for _ in prompts]
    reqs = [Request(i) for i in pool_index]
    barrier = threading.Barrier(len(prompts))
    threads = [threading.Thread(target=_stream_one, args=(cl, model_id, p, max_tokens, extra, r, barrier),
                                daemon=True) for cl, p, r in zip(clients, prompts, reqs)]
    cpu = time.process_time()        # the client threads' CPU (the main thread only waits)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    cpu = time.process_time() - cpu
    for cl, r in zip(clients, reqs):
        cl.close()
        r.round_cpu_s = cpu
    return reqs


# --- figures of one level ---------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _tokens(r: Request) -> int:
    return r.completion_tokens if r.completion_tokens is not None else len(r.chunks)


def round_rates(reqs: list[Request]) -> tuple[float | None, float | None]:
    """(wall tok/s, decode tok/s) of one round; None where a request gave nothing."""
    done = [r for r in reqs if r.chunks]
    if len(done) != len(reqs):
        return None, None
    last = max(r.last for r in done)
    wall = sum(_tokens(r) for r in done) / (last - min(r.sent for r in done))
    span = last - min(r.chunks[0] for r in done)
    decode = sum(_tokens(r) - 1 for r in done) / span if span > 0 else None
    return wall, decode


def level_row(rounds: list[list[Request]], warm: list[Request], c: int, tokens: int) -> dict:
    rates = [round_rates(rs) for rs in rounds]
    walls = [w for w, _ in rates if w]
    decodes = [d for _, d in rates if d]
    reqs = [r for rs in rounds for r in rs]
    ttft = [r.chunks[0] - r.sent for r in reqs if r.chunks]
    itl = [b - a for r in reqs for a, b in zip(r.chunks, r.chunks[1:])]
    every = reqs + warm
    toks = sum(_tokens(r) for r in reqs)
    return {"clients": c, "rounds": len(rounds), "tok_s_wall": statistics.median(walls) if walls else None,
            "tok_s_decode": statistics.median(decodes) if decodes else None, "tok_s_wall_rounds": walls,
            "tok_s_decode_rounds": decodes,
            "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
            "itl_p50_ms": _ms(_pct(itl, 50)), "itl_p99_ms": _ms(_pct(itl, 99)), "itl_samples": len(itl),
            "chunks_per_token": sum(len(r.chunks) for r in reqs) / toks if toks else None,
            "client_cpu_ms_per_token": sum(rs[0].round_cpu_s for rs in rounds if rs) / toks * 1e3 if toks else None,
            "requests": len(every), "requests_ok": sum(r.ok(tokens) for r in every),
            "errors": sorted({r.error for r in every if r.error})[:3],
            "short": [(r.prompt, r.finish, r.completion_tokens) for r in every if not r.error and not r.ok(tokens)][:5],
            "texts": {r.prompt: r.text for r in every}}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


# --- the runtime's own references ------------------------------------------------------------------------------

def bench_rows(model: Path, offload_gb: float, threads: int, prompts: list[str], levels: tuple[int, ...],
               tokens: int, runs: int, work: Path) -> list[dict]:
    """`moe-offload bench --arms sparse-first` at the same budget, threads and prompts: its JSON rows."""
    work.mkdir(parents=True, exist_ok=True)
    pfile, out = work / "bench-prompts.txt", work / "bench.json"
    pfile.write_text("\n".join(prompts) + "\n")
    out.unlink(missing_ok=True)
    cmd = [str(BIN / "moe-offload"), "bench", str(model), "--arms", "sparse-first", "--offload-gb",
           f"{offload_gb:.6f}", "--concurrency", ",".join(map(str, levels)), "--max-new-tokens", str(tokens),
           "--runs", str(runs), "--threads", str(threads), "--prompts", str(pfile), "--device", "cpu",
           "--json", str(out)]
    p = subprocess.run(cmd, env=_threads_env(threads), capture_output=True, text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0 or not out.is_file():
        raise RuntimeError(f"bench exit {p.returncode}: {p.stderr[-1500:]}")
    return json.loads(out.read_text())


def generate_ref(model: Path, offload_gb: float, threads: int, prompts: list[str], tokens: int, runs: int) -> dict:
    """The generate path (model.generate, greedy, EOS ignored) in a child: ITL / TTFT of single requests."""
    job = json.dumps({"model": str(model), "offload_gb": offload_gb, "threads": threads, "prompts": prompts,
                      "tokens": tokens, "runs": runs})
    p = subprocess.run([str(BIN / "python"), __file__, "--generate-child", job], env=_threads_env(threads),
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"generate child exit {p.returncode}: {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _generate_child(job: dict) -> dict:
    import statistics

    import torch

    torch.set_num_threads(job["threads"])
    import moe_offload as mo
    from moe_offload.loading.loader import load_tokenizer
    from moe_offload.measure.timing import greedy_generate

    model, _ = mo.load(job["model"], offload_gb=job["offload_gb"], device="cpu", backend="uva")
    tok = load_tokenizer(job["model"])
    cpu, itl, ttft, texts = torch.device("cpu"), [], [], {}
    with torch.no_grad():
        for i, prompt in enumerate(job["prompts"]):
            enc = tok([prompt], return_tensors="pt")
            for r in range(job["runs"] + (1 if i == 0 else 0)):     # the first prompt's first run warms up
                run = greedy_generate(model, enc, job["tokens"], cpu)
                if i == 0 and r == 0:
                    continue
                itl += run.itl_s
                ttft.append(run.ttft_s)
            texts[prompt] = tok.decode(run.token_ids[0].tolist(), skip_special_tokens=True)
    return {"itl_p50_ms": statistics.median(itl) * 1e3, "itl_samples": len(itl),
            "tok_s_itl": 1 / statistics.median(itl), "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "texts": texts, "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--generate-child":
        print(json.dumps(_generate_child(json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: serve_bench_peers.py --generate-child JOB (run by serve_bench.py)")
