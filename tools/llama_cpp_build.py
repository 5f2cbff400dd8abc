"""llama.cpp: built from the llama-cpp-python source package, its converter, and its smoke check.

The source package (``llama_cpp_python-<version>.tar.gz``, fetched with pip and kept under ``downloads/``)
ships llama.cpp in ``vendor/llama.cpp``; that folder is extracted (its test vocabularies left out), the
targets the project uses are built statically with cmake, and the converter's sources are kept beside the
binaries. ``convert_cmd`` is the converter's command line with the pre-tokenizer patch (see ``convert`` in
tools/engines.py); ``smoke_llama`` converts the smoke model and runs llama-completion and llama-server on it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from engine_cache import (STAMP_SCHEMA, EngineError, Log, clean_stale, kill_group, pip_python, put_in_place,
                          read_stamp, repo_python, root_dir, threads, write_stamp)
from smoke_model import SMOKE_IDS, make_tiny, smoke_work

LLAMA_CPP_PYTHON_VERSION = os.environ.get("MOE_OFFLOAD_LLAMA_CPP_PYTHON_VERSION", "0.3.36")
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
SMOKE_TEXT = "the quick brown fox"
SMOKE_OT = r"blk\.0\.ffn_(gate|up|down)_exps\.weight=CPU"


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
