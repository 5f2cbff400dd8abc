"""llama.cpp's own CPU kernels (ggml) on one MoE layer: the llama.cpp half of benchmarks/kernel_bench.py.

`ensure_ggml` builds, once, llama.cpp's ggml as static libraries from the sources `make engines` keeps (the same
llama.cpp commit and cmake flags as the engines' binaries, `tools/engines.py where --json` says where) and links
benchmarks/ggml_layer.cpp against them; the result is cached under the engines folder, keyed by the llama.cpp
version and the harness source's digest (about 30 s on two cores). `bench_ggml` runs the harness, one process
per (format, thread count, tokens), with the expert ids kernel_bench.py gives every engine.

The harness builds the graph llama.cpp builds for a Qwen3-MoE / gpt-oss FFN at decode (ggml_mul_mat_id on
the gate and up stacks, ggml_swiglu_split, ggml_mul_mat_id on the down stack, routing weights, sum over the k
experts), keeps one graph and one thread pool, and times each ggml_graph_compute call: llama.cpp's decode of
that layer, its activations converted to the weights' dot-product type inside the call as llama.cpp does
(bf16 to bf16; Q8_0, Q4_0 and MXFP4 against Q8_0 activations).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = Path(__file__).resolve().parent / "ggml_layer.cpp"
FORMATS = {"bf16": "bf16", "mxfp4": "mxfp4", "Q8_0": "q8_0", "Q4_0": "q4_0"}   # kernel_bench format: harness's


def engines_llama() -> dict:
    """`tools/engines.py where --json`'s llama_cpp entry."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "engines.py"), "where", "--json"],
                         capture_output=True, text=True)
    try:
        return json.loads(out.stdout)["llama_cpp"]
    except (ValueError, KeyError):
        return {"ok": False, "missing": f"tools/engines.py where --json: {out.stderr.strip()[-200:]}"}


def ensure_ggml() -> tuple[Path | None, str, dict]:
    """(the harness binary, '', {version, commit}) built once and cached; or (None, why, {})."""
    llama = engines_llama()
    if not llama.get("ok"):
        return None, f"llama.cpp is not built (make engines): {llama.get('missing')}", {}
    src = Path(llama["dir"]) / "src"
    digest = hashlib.sha256(HARNESS.read_bytes()).hexdigest()[:12]
    final = Path(llama["dir"]).parent / f"ggml-layer-{llama['version']}-{digest}"
    info = {"version": llama["version"], "commit": llama.get("commit"), "binary": str(final / "ggml_layer")}
    if (final / "ggml_layer").is_file():
        return final / "ggml_layer", "", info
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            return None, f"{tool} is not on PATH", {}
    print(f"building llama.cpp's ggml and {HARNESS.name} into {final} (once; cached) ...", file=sys.stderr)
    flags = list(llama["stamp"]["key"]["cmake_flags"])
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ggml-layer-", dir=final.parent))
    try:
        steps = [["cmake", "-S", str(src), "-B", str(tmp / "build")] + flags,
                 ["cmake", "--build", str(tmp / "build"), "-j", str(os.cpu_count() or 1), "--target", "ggml"]]
        libs = [str(tmp / "build" / "ggml" / "src" / f"libggml{s}.a") for s in ("", "-cpu", "-base")]
        steps.append(["c++", "-O2", "-std=c++17", "-march=native", "-I", str(src / "ggml" / "include"), str(HARNESS),
                      "-o", str(tmp / "ggml_layer")] + libs + ["-lpthread", "-fopenmp"])
        for cmd in steps:
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                return None, f"{' '.join(cmd[:3])} failed: {(out.stderr or out.stdout).strip()[-300:]}", {}
        shutil.rmtree(tmp / "build")
        tmp.replace(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "ggml_layer", "", info


def bench_ggml(binary: Path, H, E, I, k, fmt, T, ids_by_tokens, warmup: int) -> dict:
    """{"rows": [{"tokens", "times_us"} per token count]} (warm-up calls dropped) or {"error": why}."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for S, calls in ids_by_tokens.items():
            path = Path(d) / f"ids-{S}.bin"
            flat = [i for call in calls for i in call]
            path.write_bytes(b"".join(int(i).to_bytes(4, "little") for i in flat))
            cmd = [str(binary), FORMATS[fmt], str(H), str(E), str(I), str(k), str(S), str(T), str(path),
                   str(len(calls))]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                     env={**os.environ, "OMP_NUM_THREADS": str(T)})
            except subprocess.TimeoutExpired:
                return {"error": "timed out after 900 s"}
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                return {"error": f"exit {out.returncode}: {(out.stderr.strip().splitlines() or ['-'])[-1][-300:]}"}
            got = json.loads(lines[-1])
            if not got["finite"]:
                return {"error": "the layer's output was not finite"}
            rows.append({"tokens": S, "times_us": got["times_us"][warmup:]})
    return {"rows": rows}
