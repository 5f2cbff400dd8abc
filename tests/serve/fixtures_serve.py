"""Shared by the serve tests: a tiny qwen3_moe model, the budgets it is served under, greedy references from
plain `model.generate`, and a real uvicorn server in a thread.

Imported explicitly (not a conftest). The model is written by `make_tiny` (2 layers, 8 experts, top-k 2,
vocab 512, fp32); nothing is fetched from a hub. Every server binds an ephemeral port and is stopped by the
context manager that started it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch

import moe_offload as mo
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

# Eight prompts of different lengths (2 to 25 tokens with the tiny tokenizer).
PROMPTS = (
    "The harbour master counted seven ships",
    "A river",
    "Once upon a time in a land far away there lived",
    "x",
    "Hello world, how are",
    "The storm reached the coast and",
    "Numbers: 1 2 3 4 5 6 7 8 9",
    "Quiet",
)
# fp32 batched and single decoding differ by ~1e-6 in a logit; a reference whose best two logits are closer than
# this would make a token comparison luck rather than a check.
MIN_MARGIN = 1e-4
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# An expert of this model: gate_up (192 x 64) + down (64 x 96), fp32.
EXPERT_BYTES = (192 * 64 + 64 * 96) * 4


def make_folder(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("serve") / "tiny", family="qwen3_moe", layers=2, experts=8, top_k=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny model folder, written once per test module."""
    return make_folder(tmp_path_factory)


def budgets(folder: Path) -> dict[str, dict]:
    """Load options per arm: experts on the host read by uva or prefetch, the same with a device cache, and a
    CPU-only budget that leaves some experts on the disk."""
    total = mo.plan(folder, offload_gb=0).total_bytes
    host = dict(offload_gb=total / 2 / GiB)
    return {
        "uva": dict(host, backend="uva"),
        "prefetch": dict(host, backend="prefetch"),
        "cache": dict(host, backend="uva", cache_gb=4 * EXPERT_BYTES / GiB),
        "disk": dict(device_memory_gb=total // 3 / GiB + 1, host_memory_gb=total // 3 / GiB, reserve_gb=1,
                     cpu_only=True),
    }


def load(folder: Path, arm: str):
    """(model, plan) of one budget arm; the disk arm really has experts on the disk."""
    model, plan = mo.load(folder, **budgets(folder)[arm])
    if arm == "disk":
        assert model.moe_offload_runtime.disk is not None
        assert any(t.tier == "disk" and t.role == "routed_expert" for t in plan.tensors)
    else:
        assert any(t.tier == "host" and t.role == "routed_expert" for t in plan.tensors)
    return model, plan


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@dataclass(frozen=True)
class Reference:
    """Greedy tokens of plain `model.generate` past EOS, and the smallest top-2 logit margin over its steps."""

    tokens: list[int]
    margin: float


def reference(model, ids: list[int], new_tokens: int) -> Reference:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=[], output_logits=True, return_dict_in_generate=True)
    top = torch.cat(out.logits).topk(2, dim=-1).values
    return Reference(out.sequences[0, len(ids):].tolist(), float((top[:, 0] - top[:, 1]).min()))


# --- a real server in a thread ---------------------------------------------------------------------------


@dataclass
class Live:
    """A running server: its base URL (no /v1) and what make_server made."""

    url: str
    served: object    # server.Served


@contextlib.contextmanager
def serving(model, plan, tok, **options) -> Iterator[Live]:
    """make_server on an ephemeral port of 127.0.0.1, run in a thread until the block ends (then stopped and
    closed, whatever happened in the block)."""
    from moe_offload.serve.server import ServeOptions, bind, make_server

    opts = ServeOptions(**{"served_name": "tiny", "context": 256, "page_size": 16, "shutdown_timeout": 2.0,
                           **options})
    sock = bind("127.0.0.1", 0)
    served = make_server(model, plan, tok, opts)
    thread = threading.Thread(target=served.server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not served.server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        host, port = sock.getsockname()[:2]
        yield Live(f"http://{host}:{port}", served)
    finally:
        served.server.should_exit = True
        thread.join(timeout=30)
        served.close()
        sock.close()
    assert not thread.is_alive(), "the server thread did not stop"


def http(url: str, *, method: str = "GET", body: bytes | dict | None = None,
         headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, bytes]:
    """(status, headers, raw body) of one request; an HTTP error status is returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = http(url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(raw.decode()) for s in fam.samples}


def families(url: str) -> dict[str, str]:
    """/metrics family name -> its type (counter, gauge, histogram)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, raw = http(url + "/metrics")
    return {fam.name: fam.type for fam in text_string_to_metric_families(raw.decode())}
