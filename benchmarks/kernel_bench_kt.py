"""KTransformers' CPU MoE kernels (kt-kernel, PyPI) on one layer: the peer half of benchmarks/kernel_bench.py.

Parent side (imported by kernel_bench.py, our venv): `ensure_kt` makes kt-kernel's own venv once (its wheel pins
another torch than ours and its Python wrappers assume a CUDA torch; its C++ extension does not link libtorch, so
it runs beside the torch we pin: `python -m venv`, `pip install torch==<ours>`, `pip install --no-deps
kt-kernel==0.7.2`); `bench_kt` runs this file with that venv's python, one process per (kernel class, thread
count), so that a kernel that fails or crashes costs one row:

    <kt venv>/bin/python benchmarks/kernel_bench_kt.py '<json job>'

Child side: the job names the shape (E, top_k, H, I), the format, the extension class, the thread count and the
expert ids of every call (the same ids kernel_bench.py gives our kernel). The extension module is loaded straight
from the installed package (kt_kernel/_kt_kernel_ext_<variant>.so, the variant kt_kernel._cpu_detect picks; the
package's __init__ imports CUDA-minded wrappers), and driven as kt_kernel.utils.{amx,llamafile} drive it: a
CPUInfer over one WorkerPoolConfig subpool of T threads, a MOEConfig with per-expert weight pointers (bf16, FP8
with float32 128x128 block scales, MXFP4 with its e8m0 scales as bf16, as NativeMoEWrapper.load_weights) or one
stacked pointer (the online-quantized AMXInt8/AMXInt4 and the llamafile GGUF kernel), `load_weights_task`, then
per call `forward_task(bsz, k, ids, routing weights, x bf16, out bf16)` submitted and synced. That forward is the
whole routed-expert layer: gate and up, SiLU * up, down, routing-weighted sum. Weights are random (speed does not
depend on their values). Prints one JSON line: {"rows": [...]} or {"error": "..."}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


KT_VERSION = "0.7.2"
KT_VENV = Path(os.environ.get("MOE_OFFLOAD_ENGINES_DIR", Path.home() / ".cache" / "moe-offload" / "engines")) \
    / "kt-kernel-venv"


# --- parent side (our venv) ----------------------------------------------------------------------------------

def ensure_kt(torch_version: str) -> tuple[Path | None, str]:
    """kt-kernel's venv python (created once: torch as ours, then kt-kernel without its deps), or None and why."""
    py = KT_VENV / "bin" / "python"
    check = [str(py), "-c", f"import importlib.metadata as m, torch; assert m.version('kt-kernel') == '{KT_VERSION}'"]
    if py.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return py, ""
    print(f"creating {KT_VENV} (once; cached) ...", file=sys.stderr)
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(KT_VENV)],
             [str(py), "-m", "pip", "install", "-q", f"torch=={torch_version.split('+')[0]}"],
             [str(py), "-m", "pip", "install", "-q", "--no-deps", f"kt-kernel=={KT_VERSION}"]]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            return None, f"{' '.join(cmd[-3:])} failed: {out.stderr.strip()[-300:]}"
    return py, ""


def bench_kt(py: Path, H, E, I, k, fmt, cls, T, ids_by_tokens, warmup: int) -> dict:
    job = {"E": E, "top_k": k, "H": H, "I": I, "format": fmt, "cls": cls, "threads": T, "warmup": warmup,
           "max_len": 32, "ids": {str(S): calls for S, calls in ids_by_tokens.items()}}
    env = {**os.environ, "OMP_NUM_THREADS": str(T)}
    try:
        out = subprocess.run([str(py), str(Path(__file__).resolve()), json.dumps(job)], capture_output=True,
                             text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"exit {out.returncode}: {(out.stderr.strip().splitlines() or ['(no stderr)'])[-1][-300:]}"}
    return json.loads(lines[-1])


# --- child side (kt-kernel's venv) -----------------------------------------------------------------------------

def load_ext():
    """kt_kernel_ext for this CPU, without importing kt_kernel's Python wrappers."""
    import torch  # noqa: F401  (the extension expects torch's symbols loaded)

    pkg = Path(importlib.util.find_spec("kt_kernel").submodule_search_locations[0])
    sys.path.insert(0, str(pkg))
    from _cpu_detect import detect_cpu_features

    variant = detect_cpu_features()
    so = next(pkg.glob(f"_kt_kernel_ext_{variant}.*.so"))
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext, variant


def bf16_random(*shape):
    """bf16 of random sign and mantissa, exponent fixed (|w| in [2^-7, 2^-6)): no NaN, no subnormals."""
    import torch

    bits = torch.randint(-32768, 32767, shape, dtype=torch.int16)
    return ((bits & 0x807F) | 0x3C00).view(torch.bfloat16)


def bytes_random(*shape, lo=0, hi=256):
    import torch

    return torch.randint(lo, hi, shape, dtype=torch.uint8)


def fp8_random(*shape):
    """e4m3 bytes without the NaN codes 0x7F / 0xFF."""
    b = bytes_random(*shape, hi=0x7F)
    return b | (bytes_random(*shape, hi=2) << 7)


def ggml_blocks(kind: str, E: int, O: int, K: int):
    """Random GGUF rows of `kind` (Q4_0: fp16 scale + 16 bytes of nibbles per 32; Q8_0: fp16 scale + 32 int8)."""
    import torch

    per = {"Q4_0": 18, "Q8_0": 34}[kind]
    b = bytes_random(E * O * (K // 32), per)
    b[:, :2] = torch.full((1,), 0.01, dtype=torch.float16).view(torch.uint8)   # a finite scale in each block
    return b.reshape(-1)


def build(ext, job, cpu):
    """The MOE object, loaded, and what must stay alive with it."""
    import torch

    E, k, H, I = job["E"], job["top_k"], job["H"], job["I"]
    fmt, cls_name = job["format"], job["cls"]
    mask = torch.zeros(E, dtype=torch.bool)
    cfg = ext.moe.MOEConfig(E, k, H, I, mask.data_ptr())
    cfg.layer_idx, cfg.pool, cfg.max_len = 0, cpu.backend_, job["max_len"]
    keep = [mask]
    if cls_name == "MOE":   # llamafile (GGUF) backend: one stacked pointer per projection
        gtype = getattr(ext.kvcache, fmt)
        g, u, d = ggml_blocks(fmt, E, I, H), ggml_blocks(fmt, E, I, H), ggml_blocks(fmt, E, H, I)
        keep += [g, u, d]
        cfg.m_block, cfg.group_min_len, cfg.group_max_len = 32, 10, job["max_len"]
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = g.data_ptr(), u.data_ptr(), d.data_ptr()
        cfg.gate_type = cfg.up_type = cfg.down_type = gtype
        cfg.hidden_type = ext.kvcache.BF16
    elif cls_name in ("AMXInt8_MOE", "AMXInt4_MOE"):   # online quantization of bf16 stacks (save mode)
        g, u, d = bf16_random(E, I, H), bf16_random(E, I, H), bf16_random(E, H, I)
        keep += [g, u, d]
        cfg.save, cfg.load = True, False
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = g.data_ptr(), u.data_ptr(), d.data_ptr()
        tmp = tempfile.TemporaryDirectory(prefix="kt-quant-")
        keep.append(tmp)
        cfg.path = tmp.name
    else:   # native per-expert pointers, as NativeMoEWrapper.load_weights
        def mats(O, K):
            if fmt == "bf16":
                return bf16_random(O, K), None
            if fmt == "fp8":
                return fp8_random(O, K), torch.rand(-(-O // 128), -(-K // 128)) * 1e-3 + 1e-3
            if fmt == "mxfp4":   # e2m1 nibbles [O, K/2], e8m0 scales 118..130 as bf16 (the loader's conversion)
                s = bytes_random(O, K // 32, lo=118, hi=131).to(torch.int32) << 7
                return bytes_random(O, K // 2), s.to(torch.int16).view(torch.bfloat16).contiguous()
            raise ValueError(fmt)

        trip = [[mats(I, H) for _ in range(E)], [mats(I, H) for _ in range(E)], [mats(H, I) for _ in range(E)]]
        keep.append(trip)
        cfg.gate_projs, cfg.up_projs, cfg.down_projs = ([[w.data_ptr() for w, _ in p]] for p in trip)
        cfg.gate_scales, cfg.up_scales, cfg.down_scales = ([[s.data_ptr() if s is not None else 0 for _, s in p]]
                                                          for p in trip)
        if fmt == "fp8":
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 8, 128, False
        if fmt == "mxfp4":
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, 32, False
    moe = getattr(ext.moe, cls_name)(cfg)
    p2l = torch.arange(E, dtype=torch.int64)
    cpu.submit(moe.load_weights_task(p2l.data_ptr()))
    cpu.sync()
    if cls_name in ("AMXInt8_MOE", "AMXInt4_MOE"):
        del keep[1:4]   # the quantized copy is the kernel's own
    return moe, keep


def run(job) -> dict:
    import torch

    ext, variant = load_ext()
    T, k, H = job["threads"], job["top_k"], job["H"]
    wc = ext.WorkerPoolConfig()
    wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [T]
    cpu = ext.CPUInfer(wc)
    t0 = time.perf_counter()
    moe, keep = build(ext, job, cpu)
    load_s = time.perf_counter() - t0
    rows = []
    for tokens, calls in job["ids"].items():   # {"1": [[ids of token 0], ...] per call, ...}
        S = int(tokens)
        x = (torch.randn(S, H) * 0.5).to(torch.bfloat16)
        w = torch.full((S, k), 1.0 / k, dtype=torch.float32)
        out = torch.zeros(S, H, dtype=torch.bfloat16)
        bsz = torch.tensor([S], dtype=torch.int32)
        times = []
        for call in calls:
            ids = torch.tensor(call, dtype=torch.int64).reshape(S, k)
            t = time.perf_counter()
            cpu.submit(moe.forward_task(bsz.data_ptr(), k, ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                        out.data_ptr(), False))
            cpu.sync()
            times.append(time.perf_counter() - t)
        times = times[job["warmup"]:]
        if not torch.isfinite(out.float()).all():
            raise RuntimeError("non-finite output")
        rows.append({"tokens": S, "us": statistics.median(times) * 1e6, "times_us": [t * 1e6 for t in times]})
    return {"rows": rows, "variant": variant, "load_s": load_s,
            "backend": getattr(ext, "__cpu_variant__", variant)}


def main() -> int:
    job = json.loads(sys.argv[1])
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))
    try:
        res = run(job)
    except Exception as e:  # noqa: BLE001 - the row says why
        res = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
