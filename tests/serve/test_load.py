"""A load test of `moe-offload serve` over localhost with the real `openai` client.

The server is a child process (`serve --max-concurrency 8`), so its resident memory is its own to read. 64
requests go from 8 client threads: half streamed, max_tokens from 4 to 40, greedy with `ignore_eos`, each
with its own prompt; every 8th is a stream the client closes after a few chunks. Then:

- none is lost or fails: each completed request has all its tokens, each cancelled one stopped when asked;
- each completed text equals the decoded single-request `model.generate` of the same checkpoint and plan,
  loaded in this process. Greedy tokens under 8-way continuous batching equal batch-1 tokens only up to
  floating-point order, so the prompts are chosen (from a larger candidate set) where every reference step's
  top-2 logit margin is comfortable: equal text is then not luck;
- /metrics afterwards: nothing running or waiting, `requests_total{status="200"}` grew by the completed
  requests and `{status="cancelled"}` by the cancelled ones;
- the server's VmRSS after the run is within RSS_GROWTH of its level after a warm-up round of the same mix:
  finished and cancelled requests leave nothing behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from moe_offload.prompts import CORPUS
from moe_offload.tiny.make import make_tiny


OFFLOAD = ("--offload-gb", "0.001")
CONCURRENCY = 8                  # --max-concurrency, and the client threads
REQUESTS = 64
WARMUP = 16                      # requests of the warm-up round (the same mix)
CANCEL_EVERY = 8                 # request i with i % CANCEL_EVERY == CANCEL_EVERY - 1 is closed mid-stream
CANCEL_AFTER = 3                 # text chunks a cancelled stream reads before closing
CANCEL_MAX_TOKENS = 400          # so long that a cancelled stream cannot end on its own before its close lands
MARGIN = 1e-3                    # least top-2 logit gap of a reference step (fp32 batching noise: ~1e-6)
RSS_GROWTH = 64 * 2**20          # VmRSS after the run minus after the warm-up, at most
READY_S = 180.0
SERVED = "tiny-load"


@dataclass(frozen=True)
class Spec:
    index: int
    prompt: str
    max_tokens: int
    stream: bool
    cancel: bool


@dataclass
class Outcome:
    spec: Spec
    text: str
    finish: str | None
    completion_tokens: int | None
    chunks: int


def _env() -> dict:
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _candidates(n: int) -> list[str]:
    """Distinct prompts of 3 to 9 words, windows of the built-in corpus."""
    words = CORPUS.split()
    return [" ".join(words[5 * i: 5 * i + 3 + i % 7]) for i in range(n)]


def _max_tokens(i: int) -> int:
    return 4 + (i * 13) % 37        # 4..40, mixed across neighbours


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("load") / "tiny-load", family="qwen3_moe", layers=2, experts=8,
                     top_k=2)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The serve child, started before the references are computed (its loading overlaps theirs)."""
    logs = tmp_path_factory.mktemp("load-logs")
    port = _free_port()
    err_path = logs / "serve.err"
    with open(logs / "serve.out", "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moe_offload.cli.main", "serve", str(model_dir), *OFFLOAD,
                                 "--port", str(port), "--max-concurrency", str(CONCURRENCY), "--max-queue", "64",
                                 "--served-model-name", SERVED], env=_env(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err)
    try:
        yield proc, port, err_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def loaded(model_dir):
    import moe_offload as mo
    from transformers import AutoTokenizer

    model, plan = mo.load(model_dir, offload_gb=0.001)
    return model, plan, AutoTokenizer.from_pretrained(model_dir)


def _reference(model, tokenizer, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """Single-request greedy ids (no EOS: as `ignore_eos`) and the least top-2 logit margin over the steps."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=[], output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    assert len(new) == max_tokens
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    return new, float((top2[:, 0] - top2[:, 1]).min())


@pytest.fixture(scope="module")
def workload(server, loaded):
    """The 64 specs and the expected text of every one that completes; prompts kept where the margin holds."""
    model, _, tokenizer = loaded
    specs, expected, rejected = [], {}, 0
    pool = iter(_candidates(4 * REQUESTS))
    for i in range(REQUESTS):
        cancel = i % CANCEL_EVERY == CANCEL_EVERY - 1
        for prompt in pool:
            if cancel:
                break
            ids, margin = _reference(model, tokenizer, prompt, _max_tokens(i))
            if margin >= MARGIN:
                expected[i] = tokenizer.decode(ids, skip_special_tokens=True)
                break
            rejected += 1
        else:
            pytest.fail(f"fewer than {REQUESTS} of the candidate prompts have a top-2 margin of {MARGIN}")
        specs.append(Spec(i, prompt, CANCEL_MAX_TOKENS if cancel else _max_tokens(i), stream=i % 2 == 1 or cancel,
                          cancel=cancel))
    assert rejected < REQUESTS   # most prompts qualify: the margin filter trims outliers, it does not pick a few
    return specs, expected


def _one(client, spec: Spec) -> Outcome:
    kwargs = dict(model=SERVED, prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
    if not spec.stream:
        done = client.completions.create(**kwargs)
        return Outcome(spec, done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens, 0)
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, finish, usage, chunks = [], None, None, 0
    try:
        for part in stream:
            if part.usage is not None:
                usage = part.usage.completion_tokens
            for choice in part.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
                chunks += bool(choice.text)
            if spec.cancel and chunks >= CANCEL_AFTER:
                break
    finally:
        stream.close()   # for a cancelled request: the client goes away mid-stream
    return Outcome(spec, "".join(text), finish, usage, chunks)


def _round(port: int, specs: list[Spec]) -> list[Outcome]:
    """Every spec, CONCURRENCY at a time; an exception in any request fails the round."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            return list(pool.map(lambda s: _one(client, s), specs))
    finally:
        client.close()


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _requests(m: dict, status: str) -> float:
    return m.get(("moe_offload_requests_total", (("status", status),)), 0.0)


def _settled(port: int, timeout: float = 60) -> dict:
    """The metrics once nothing runs or waits (a closed stream's slot frees as the server sees the close)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(port)
        idle = m[("moe_offload_sequences_running", ())] == 0 and m[("moe_offload_sequences_waiting", ())] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def _wait_ready(proc, port: int, err_path: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited {proc.returncode}:\n{err_path.read_text()}")
        if "serving" in err_path.read_text():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.1)
    pytest.fail(f"serve did not come up in {READY_S:.0f} s:\n{err_path.read_text()}")


def _check(outcomes: list[Outcome], expected: dict[int, str]) -> None:
    for o in outcomes:
        s = o.spec
        if s.cancel:   # closed after CANCEL_AFTER chunks, before any end
            assert o.chunks == CANCEL_AFTER and o.finish is None and o.completion_tokens is None, o
            continue
        assert o.finish == "length" and o.completion_tokens == s.max_tokens, o
        assert o.text == expected[s.index], f"request {s.index} ({'stream' if s.stream else 'plain'}): {o}"


def test_64_mixed_requests_complete_equal_their_single_runs_and_leave_nothing_behind(server, workload, loaded):
    proc, port, err_path = server
    specs, expected = workload
    _wait_ready(proc, port, err_path)
    _, plan, _ = loaded
    m = _metrics(port)   # the server's plan is this process's: same checkpoint, same budget
    assert m[("moe_offload_plan_bytes", (("tier", "host"),))] == sum(t.bytes for t in plan.tensors if t.tier == "host")

    _check(_round(port, specs[:WARMUP]), expected)
    before = _settled(port)
    rss_warm = _rss(proc.pid)

    start = time.monotonic()
    outcomes = _round(port, specs)
    seconds = time.monotonic() - start
    after = _settled(port)
    rss_after = _rss(proc.pid)

    assert len(outcomes) == REQUESTS
    _check(outcomes, expected)
    cancelled = sum(s.cancel for s in specs)
    assert after[("moe_offload_sequences_running", ())] == 0 and after[("moe_offload_sequences_waiting", ())] == 0
    assert _requests(after, "200") - _requests(before, "200") == REQUESTS - cancelled
    assert _requests(after, "cancelled") - _requests(before, "cancelled") == cancelled
    assert not [k for k in after if k[0] == "moe_offload_requests_total" and k[1] not in
                ((("status", "200"),), (("status", "cancelled"),))], "some request was refused or failed"
    assert rss_after - rss_warm <= RSS_GROWTH, (
        f"VmRSS grew {(rss_after - rss_warm) / 2**20:.1f} MiB over {REQUESTS} requests ({seconds:.1f} s)")
    assert proc.poll() is None and "Traceback" not in err_path.read_text()
