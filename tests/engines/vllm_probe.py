"""Run inside vLLM's own venv by tests/engines/test_vllm.py: what vLLM itself does with our checkpoints and options.

    python vllm_probe.py JOB.json OUT.json

JOB.json: {"models": [{"name": ..., "dir": ..., "prompt_ids": [...], "max_tokens": 8}],
           "parse": [[arg, ...], ...]}   (parsed with --model the first model's folder: from_cli_args reads it)
OUT.json: {"vllm": version,
           "parse": [{"args": [...], "cpu_offload_gb": float, "cpu_offload_params": [...]} or {"args", "error"}],
           "models": {name: {"tokens": [...], "top": [[[id, logprob], ...] per step],
                             "params": [[layer, name, shape, dtype, nbytes], ...] (each decoder layer as
                                        vLLM's offloader sees it: layer-relative names, declaration order),
                             "loaded": [name, ...] (the loaded model's parameters, full names),
                             "load_s": s} or {"error": "..."}}}

Several models are loaded in turn by one process: each start costs tens of seconds on a small CPU. The engine
core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the offloader's view can be recorded and `LLM.apply_model`
reads the model directly.
Written incrementally: OUT.json is rewritten after each model, so a crash leaves what came before.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


_WRAPPED: list = []


def _record_wrapped_layers() -> None:
    """Record each decoder layer as `make_layers` hands it to the offloader (`get_offloader().wrap_modules`),
    before any weight is loaded: the parameters, in the order, with the shapes and bytes that vLLM's
    UVAOffloader walks (`module.named_parameters()`). After loading, the CPU backend repacks some weights (a
    linear layer's `weight` becomes an empty tensor beside its oneDNN handle), so the loaded model's own
    parameters are not what the offloader saw."""
    from vllm.model_executor.offloader import base

    original = base.NoopOffloader.wrap_modules

    def wrap_modules(self, modules_generator, prefix=""):
        modules = original(self, modules_generator, prefix)
        for i, module in enumerate(modules):
            _WRAPPED.extend([i, f"{prefix + '.' if prefix else ''}{n}", list(p.shape),
                             str(p.dtype).removeprefix("torch."), p.numel() * p.element_size()]
                            for n, p in module.named_parameters())
        return modules

    base.NoopOffloader.wrap_modules = wrap_modules


def parse(args: list[str], model: str) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    try:
        ns = parser.parse_args(["--model", model, *args])
        ea = EngineArgs.from_cli_args(ns)
    except (SystemExit, Exception) as e:   # argparse exits on a bad option
        return {"args": args, "error": f"{type(e).__name__}: {e}"}
    return {"args": args, "cpu_offload_gb": ea.cpu_offload_gb, "cpu_offload_params": sorted(ea.cpu_offload_params)}


def probe(m: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    _WRAPPED.clear()
    llm = LLM(model=m["dir"], dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
              limit_mm_per_prompt=m.get("limit_mm_per_prompt"))
    load_s = time.monotonic() - t0
    try:
        params = list(_WRAPPED)
        loaded = llm.apply_model(lambda model: [n for n, _ in model.named_parameters()])[0]
        sp = SamplingParams(temperature=0, max_tokens=m.get("max_tokens", 8), ignore_eos=True, logprobs=2)
        out = llm.generate([{"prompt_token_ids": m["prompt_ids"]}], sp, use_tqdm=False)[0].outputs[0]
        top = [sorted(([tid, lp.logprob] for tid, lp in step.items()), key=lambda x: -x[1]) for step in out.logprobs]
        return {"tokens": list(out.token_ids), "top": top, "params": params, "loaded": loaded, "load_s": round(load_s, 1)}
    finally:
        del llm
        _cleanup()


def _cleanup() -> None:
    """What vLLM's own tests call between engines in one process: a failed start otherwise leaves its
    distributed groups half torn down and every later start fails ("pipeline model parallel group is not
    initialized")."""
    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main(job_path: str, out_path: str) -> None:
    import vllm

    job = json.loads(open(job_path).read())
    result = {"vllm": vllm.__version__, "parse": [parse(a, job["models"][0]["dir"]) for a in job.get("parse", [])], "models": {}}

    def save():
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out_path + ".tmp", out_path)

    save()
    _record_wrapped_layers()
    for m in job.get("models", []):
        try:
            result["models"][m["name"]] = probe(m)
        except Exception as e:
            _cleanup()
            lines = [ln for ln in traceback.format_exception_only(type(e), e)]
            result["models"][m["name"]] = {"error": "".join(lines).strip()[-2000:],
                                           "trace": traceback.format_exc()[-4000:]}
        save()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1], sys.argv[2])
