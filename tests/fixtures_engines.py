"""The real peer engines (llama.cpp, vLLM CPU) as the tests see them: where they are, and small helpers.

Imported explicitly (not a conftest). Everything here reads ``python3 tools/engines.py where --json``
(``make engines`` installs and caches the engines outside the repository); a test that needs an engine calls
``require(name)``, which *fails* the test (never skips it) with the engine's ``missing`` line when the engine
is not installed. Tests that use an engine carry ``@pytest.mark.engines``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINES_PY = REPO / "tools" / "engines.py"
_KEYS = {"llama.cpp": "llama_cpp", "llama_cpp": "llama_cpp", "vllm": "vllm"}


@functools.lru_cache(maxsize=1)
def engines() -> dict:
    """The parsed ``tools/engines.py where --json`` (schema 1), read once per session."""
    out = subprocess.run([sys.executable, str(ENGINES_PY), "where", "--json"], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        pytest.fail(f"`tools/engines.py where --json` exited {out.returncode}: {out.stderr.strip()}", pytrace=False)
    return json.loads(out.stdout)


def require(name: str) -> dict:
    """The ``where --json`` entry of engine `name` ("llama.cpp" / "llama_cpp" or "vllm"); fails the test when
    that engine is not ok, with its ``missing`` line and how to get it."""
    key = _KEYS.get(name, name)
    entry = engines().get(key)
    if not entry or not entry.get("ok"):
        missing = (entry or {}).get("missing") or f"engine {name!r} not in `tools/engines.py where --json`"
        pytest.fail(f"engine {name} is not installed: {missing}; run `make engines`", pytrace=False)
    return entry


# ---------------------------------------------------------------------------------------
# llama.cpp

import contextlib
import re
import socket
import time
import urllib.request

_GGUF: dict[str, Path] = {}
# Converter options per make-tiny family: Qwen3-Next's converter expects released checkpoints' MTP layers
# (make-tiny writes none) unless told --no-mtp.
CONVERT_ARGS = {"qwen3_next": ["--no-mtp"]}


def convert(folder: Path, family: str, tmp_path_factory) -> Path:
    """The f32 GGUF of a Hugging Face folder, by llama.cpp's own converter (`tools/engines.py convert`), once
    per folder and session."""
    key = str(Path(folder).resolve())
    if key not in _GGUF:
        entry = require("llama.cpp")
        out = tmp_path_factory.mktemp("gguf") / f"{family}.gguf"
        extra = CONVERT_ARGS.get(family, [])
        r = subprocess.run([*entry["convert_command"], str(folder), str(out), "--outtype", "f32",
                            *(["--", *extra] if extra else [])], capture_output=True, text=True, errors="replace",
                           timeout=600)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-5:])
            pytest.fail(f"llama.cpp's converter failed on {family}: {tail}", pytrace=False)
        _GGUF[key] = out
    return _GGUF[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(gguf: Path, timeout: float = 120.0):
    """A llama-server on 127.0.0.1 serving `gguf`: yields its base URL; always terminated."""
    entry = require("llama.cpp")
    port = _free_port()
    proc = subprocess.Popen([entry["server"], "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "512", "-t", str(entry.get("threads") or 2), "-np", "1", "--no-warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace")
                pytest.fail(f"llama-server exited {proc.returncode} on {gguf.name}: {out[-2000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except Exception:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server not healthy within {timeout:.0f} s on {gguf.name}", pytrace=False)
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llama_greedy(gguf: Path, ids, n: int) -> tuple[list[int], list[float | None]]:
    """llama.cpp's greedy continuation of the token-id prompt `ids` (no BOS added): (n tokens, per new token the
    margin top1 - top2 of its log-probabilities, which is the logit margin; None where llama.cpp gave no
    probabilities for that token, as for one that leaves an incomplete UTF-8 sequence)."""
    body = {"prompt": [int(i) for i in ids], "n_predict": n, "temperature": -1, "n_probs": 2, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True}
    with llama_server(gguf) as url:
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
    tokens = [int(t) for t in out["tokens"]]
    probs = list(out.get("completion_probabilities") or [])
    margins: list[float | None] = []
    for tok in tokens:   # entries come in order, one per token that has one: align by id
        if probs and probs[0].get("id") == tok:
            top = probs.pop(0)["top_logprobs"]
            margins.append(top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else None)
        else:
            margins.append(None)
    return tokens, margins


_OVERRIDDEN = re.compile(r"tensor (\S+) \([^)]*\) buffer type overridden to CPU")


def llama_overrides(gguf: Path, args) -> set[str]:
    """The tensors llama.cpp itself reports overridden to the CPU buffer when loading `gguf` with `args`
    (`llama-completion -v -fit off ARGS -n 1 -p hi`)."""
    entry = require("llama.cpp")
    cmd = [entry["completion"], "-m", str(gguf), "-v", "-fit", "off", *map(str, args), "-n", "1", "-p", "hi",
           "-t", str(entry.get("threads") or 2)]
    # llama.cpp's logger hands lines to a worker thread and never flushes it at exit (common/log.cpp: "logs may be
    # lost if not flushed before the program exits"): on a loaded machine a run can end before its load-time lines
    # are printed. A run that shows none is run again (three at most); one that overrides nothing shows none each time.
    for _ in range(3):
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
        if r.returncode != 0:
            pytest.fail(f"llama-completion exited {r.returncode}: {(r.stdout + r.stderr)[-2000:]}", pytrace=False)
        got = set(_OVERRIDDEN.findall(r.stdout + r.stderr))
        if got:
            return got
    return got
