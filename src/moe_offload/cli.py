"""The `moe-offload` command. The contract is ../shared/CLI.md: extend it, never break it.

Human output goes to the terminal; `--json` prints one JSON document on stdout and nothing
else there. A user error exits with status 2 and one `error:` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import MoeOffloadError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, per the contract, instead of usage + message
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _budget_options(p: argparse.ArgumentParser) -> None:
    from .planner import DEFAULT_RESERVE_GB

    g = p.add_argument_group("budget")
    g.add_argument("--offload-gb", type=float, metavar="X",
                   help="offload at least X GiB of weights to host memory (0 offloads nothing)")
    g.add_argument("--device-memory", type=float, metavar="X",
                   help="the accelerator has X GiB: offload the least that makes weights + reserve fit")
    g.add_argument("--reserve-gb", type=float, metavar="X",
                   help=f"with --device-memory: room kept for activations and KV cache (default {DEFAULT_RESERVE_GB})")
    g.add_argument("--policy", default="sparse-first", choices=["sparse-first", "declaration"],
                   help="sparse-first: by access density, routed experts before dense, globally (default); "
                        "declaration: module declaration order (the legacy behaviour of today's engines)")
    g.add_argument("--offload-params", nargs="+", metavar="SEG",
                   help="only tensors whose name contains one of these whole dot-separated segment sequences "
                        "are eligible (`experts` matches `...mlp.experts.down_proj`)")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="the dtype weights are held in (default: the checkpoint's; from config.json alone, the "
                        "config's own and its quantization_config)")


def _budget_kwargs(args) -> dict:
    return dict(offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                policy=args.policy, offload_params=args.offload_params)


def _model_path(value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise MoeOffloadError(f"{path} does not exist: give a local model folder or a config.json path "
                              "(nothing is fetched from a hub)")
    return path


def cmd_plan(args) -> int:
    from . import plan as make_plan
    from .report import print_plan

    p = make_plan(_model_path(args.model), dtype=args.dtype, batch=args.batch, **_budget_kwargs(args))
    if args.save:
        _write_atomic(Path(args.save), p.to_json(indent=1))
    if args.json:
        print(p.to_json())
    else:
        if args.tensors:
            from rich.console import Console

            from .report import tensors_table

            Console().print(tensors_table(p))
        print_plan(p)
        if args.save:
            print(f"plan saved to {args.save}")
    return 0


def _runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["uva", "prefetch"], default="uva",
                   help="uva: offloaded weights read in place through device-visible views of host memory "
                        "(default); prefetch: staged onto the device before use")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator when there is one, else cpu)")


def load_for_cli(args, **extra):
    """Load MODEL with the command's budget and runtime options; returns (model, plan, tokenizer)."""
    from . import load
    from .loader import load_tokenizer

    folder = _model_path(args.model)
    if not folder.is_dir():
        raise MoeOffloadError(f"{folder} is a file: generate and bench need the model folder (weights + tokenizer)")
    tokenizer = load_tokenizer(folder)
    model, plan = load(folder, device=args.device, backend=args.backend, dtype=args.dtype,
                       progress=not getattr(args, "json", False) and sys.stderr.isatty(), **_budget_kwargs(args),
                       **extra)
    return model, plan, tokenizer


def cmd_generate(args) -> int:
    import time

    import torch

    from .planner import format_bytes

    if args.max_new_tokens < 1:
        raise MoeOffloadError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    model, plan, tokenizer = load_for_cli(args)
    runtime = model.moe_offload_runtime
    enc = tokenizer(args.prompt, return_tensors="pt").to(runtime.device)
    if enc["input_ids"].shape[1] == 0:
        raise MoeOffloadError("the prompt encodes to no tokens: give a non-empty --prompt")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if args.ignore_eos:
        # No EOS token at all for this call: decoding runs on past it with the same greedy choices
        # (min_new_tokens would instead forbid the EOS token and so change the text).
        kwargs["eos_token_id"] = []
    runtime.counter.reset()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    elapsed = time.perf_counter() - start
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    result = {
        "text": text,
        "token_ids": new,
        "device": str(runtime.device),
        "backend": runtime.backend,
        "mechanism": runtime.mechanism,
        "offloaded_bytes": plan.offloaded_bytes,
        "host_bytes": runtime.host_bytes,
        "link_bytes_per_token": runtime.counter.decode_bytes_per_token(),
        "planned_link_bytes_per_token": plan.link_bytes_per_token(1),
        "tokens_per_s": len(new) / elapsed if elapsed > 0 else None,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.prompt}{text}")
    print(f"-- {len(new)} tokens, {result['tokens_per_s']:.1f} tok/s (prefill included) on {runtime.device}, "
          f"backend {runtime.backend}", file=sys.stderr)
    print(f"-- {runtime.mechanism}", file=sys.stderr)
    print(f"-- offloaded {format_bytes(plan.offloaded_bytes)} (host memory used {format_bytes(runtime.host_bytes)}); "
          f"link bytes per decoded token: measured {format_bytes(result['link_bytes_per_token'])}, "
          f"planned {format_bytes(result['planned_link_bytes_per_token'])}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from rich.console import Console

    from .bench import DEFAULT_ARMS, DEFAULT_CONCURRENCY, parse_arms, parse_concurrency, read_prompts, run_bench
    from .plots import plot
    from .report import print_table

    if args.policy is not None or args.offload_params:
        raise MoeOffloadError("bench compares policies through --arms, not --policy / --offload-params: "
                              "use e.g. --arms declaration,sparse-first,explicit:experts")
    arms = parse_arms(args.arms or DEFAULT_ARMS)
    levels = parse_concurrency(args.concurrency or DEFAULT_CONCURRENCY)
    folder = _model_path(args.model)
    # Fail before the long run, not after it, when an output cannot be written.
    for out in (args.json, args.plot):
        if out and out != "-" and not Path(out).parent.is_dir():
            raise MoeOffloadError(f"cannot write {out}: the folder {Path(out).parent} does not exist; create it first")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise MoeOffloadError(f"--plot {args.plot}: name a .png (or .svg, .pdf) file")
    prompts = read_prompts(args.prompts) if args.prompts else None
    rows = run_bench(folder, arms=arms, concurrency=levels, runs=args.runs, max_new_tokens=args.max_new_tokens,
                     offload_gb=args.offload_gb, device_memory_gb=args.device_memory, reserve_gb=args.reserve_gb,
                     dtype=args.dtype, device=args.device, backend=args.backend, prompts=prompts,
                     same_prompt=args.same_prompt, link_gbps=args.link_gbps, threads=args.threads,
                     progress=sys.stderr.isatty())
    to_stdout = args.json == "-"
    print_table(rows, Console(stderr=True) if to_stdout else None)  # stdout holds only the JSON with --json -
    # Both outputs or neither: the plot (the one that can fail on content) first, then the JSON.
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        text = json.dumps(rows, indent=1)
        if to_stdout:
            print(text)
        else:
            try:
                _write_atomic(Path(args.json), text + "\n")
            except MoeOffloadError:
                if args.plot:
                    Path(args.plot).unlink(missing_ok=True)
                raise
            print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_make_tiny(args) -> int:
    from .tiny import make_tiny

    try:
        out = make_tiny(args.dir, family=args.family, layers=args.layers, experts=args.experts, top_k=args.top_k,
                        hidden=args.hidden, seed=args.seed, dtype=args.dtype)
    except (ValueError, FileExistsError) as exc:
        raise MoeOffloadError(str(exc)) from exc
    print(f"wrote a tiny {args.family} model to {out}")
    return 0


def _write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all (a temporary sibling renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeOffloadError(f"cannot write {path}: {exc.strerror}; choose a writable path") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-offload", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan where every weight lives (reads no tensor data)")
    p.add_argument("model", help="model folder or config.json path")
    _budget_options(p)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, for link bytes (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.add_argument("--tensors", action="store_true", help="also list every tensor with its role, density and tier")
    p.add_argument("--save", metavar="PLAN.json", help="save the plan (load it with `moe_offload.load(plan=...)`)")
    p.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="greedy decoding with the model loaded into its plan")
    g.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _budget_options(g)
    _runtime_options(g)
    g.add_argument("--json", action="store_true", help="print the result as one JSON document")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure offloading arms side by side at one budget (speed and link bytes)")
    b.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    b.add_argument("--arms",
                   help="comma-separated: resident (offload nothing; skipped when it does not fit), declaration, "
                        "sparse-first, explicit:SEG[+SEG...] (default: resident,declaration,sparse-first)")
    _budget_options(b)
    b.set_defaults(policy=None)  # arms choose the policy; an explicit --policy is refused
    _runtime_options(b)
    b.add_argument("--concurrency", metavar="C,C",
                   help="sequences decoded together, one row per level (default 1,4)")
    b.add_argument("--runs", type=int, default=3,
                   help="measured runs per arm and level, after 1 warm-up run (default 3)")
    b.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens decoded per sequence, EOS ignored (default 32)")
    b.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the built-in varied prompts)")
    b.add_argument("--same-prompt", action="store_true",
                   help="give every sequence the first prompt (flatters batched link traffic; labelled as such)")
    b.add_argument("--link-gbps", type=float, metavar="X",
                   help="host link bandwidth in GB/s (1e9 bytes/s): adds link ms per token from the measured bytes")
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch while measuring (default: torch's)")
    b.add_argument("--json", metavar="FILE", help="write the rows as one JSON list to FILE (`-`: stdout)")
    b.add_argument("--plot", metavar="FILE.png", help="write a two-panel chart: tok/s and link bytes per token")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("make-tiny", help="write a small random-weight model folder")
    t.add_argument("dir")
    t.add_argument("--family", required=True)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--experts", type=int, default=8)
    t.add_argument("--top-k", type=int, default=2)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="dtype of the saved weights (default float32)")
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoeOffloadError as exc:
        message = " ".join(str(exc).split())
        sys.stderr.write(f"error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
