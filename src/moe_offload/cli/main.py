"""moe-offload: plan, load, run and benchmark MoE models whose weights do not fit on the accelerator.

The first line is also `moe-offload --help`'s description. Commands, options and JSON fields are a
stable contract (docs/cli.md): extend them, never break them.

Human output goes to the terminal; `--json` prints one JSON document on stdout and nothing
else there. A user error exits with status 2 and one `error:` line on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ..errors import MoeOffloadError
from .plan_commands import cmd_export, cmd_make_tiny, cmd_plan, cmd_replay
from .run_commands import cmd_bench, cmd_generate, cmd_profile
from .serve_command import add_serve_parser


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, per the contract, instead of usage + message
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _budget_options(p: argparse.ArgumentParser, *, policy_options: bool = True, oracle: bool = False) -> None:
    """`policy_options=False` (bench, whose --arms choose the policy): --policy and --offload-params are
    left out of --help and parse only so that the command can refuse them with a pointer to --arms."""
    from ..planning.planner import DEFAULT_RESERVE_GB

    def shown(text: str) -> str:
        return text if policy_options else argparse.SUPPRESS

    g = p.add_argument_group("budget")
    g.add_argument("--offload-gb", type=float, metavar="X",
                   help="offload at least X GiB of weights to host memory (0 offloads nothing)")
    g.add_argument("--device-memory", type=float, metavar="X",
                   help="the accelerator has X GiB: offload the least that makes weights + reserve fit")
    g.add_argument("--reserve-gb", type=float, metavar="X",
                   help=f"with --device-memory: room kept for activations and KV cache (default {DEFAULT_RESERVE_GB})")
    g.add_argument("--host-memory", type=float, metavar="X",
                   help="the host has X GiB for offloaded weights: what leaves the device beyond it is read from the "
                        "checkpoint on disk, lowest access densities first (on a CPU-only machine --device-memory "
                        "alone already puts what does not fit in RAM on disk)")
    g.add_argument("--policy", default="sparse-first" if policy_options else None,
                   choices=["sparse-first", "declaration", "frequency", *(["oracle"] if oracle else [])],
                   help=shown("sparse-first: by access density, routed experts before dense, globally (default); "
                              "declaration: module declaration order (the legacy behaviour of today's engines); "
                              "frequency: expert by expert, least picked first, from --stats"
                              + ("; oracle: frequency with statistics from --trace itself (a floor)" if oracle
                                 else "")))
    g.add_argument("--stats", nargs="+", metavar="TRACE",
                   help=("with --policy frequency: " if policy_options else "for the frequency arm: ")
                   + "routing traces (`moe-offload profile`) whose decode tokens give each expert's pick frequency")
    g.add_argument("--offload-params", nargs="+", metavar="SEG",
                   help=shown("only tensors whose name contains one of these whole dot-separated segment "
                              "sequences are eligible (`experts` matches `...mlp.experts.down_proj`)"))
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="the dtype weights are held in (default: the checkpoint's; from config.json alone, the "
                        "config's own and its quantization_config)")


def _device_option(p: argparse.ArgumentParser) -> None:
    """--device for commands that plan without running (plan, replay)."""
    p.add_argument("--device", help="the device the plan is for: cpu (no accelerator: --device-memory then bounds RAM "
                                    "and the rest is on disk), cuda, ... (default: this machine's accelerator, else "
                                    "cpu)")


def _runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["uva", "prefetch"], default="uva",
                   help="uva: offloaded weights read in place through device-visible views of host memory "
                        "(default); prefetch: staged onto the device before use")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator when there is one, else cpu)")
    from ..routing.cache_policy import DEFAULT_CACHE_POLICY, cache_policy_names

    p.add_argument("--cache-gb", type=float, metavar="X",
                   help="device-side cache of X GiB for the offloaded routed experts decode steps fetch (a hit reads "
                        "nothing over the link); with --device-memory it is taken out of --reserve-gb (default 0: "
                        "no cache)")
    p.add_argument("--cache-policy", metavar="P",
                   help=f"with --cache-gb: {', '.join(cache_policy_names())} (default {DEFAULT_CACHE_POLICY}; belady, "
                        "the offline optimum, only in replay)")
    p.add_argument("--host-cache-gb", type=float, metavar="X",
                   help="host-memory cache of X GiB for disk-tier routed experts (a hit reads RAM, not the disk), "
                        "under --cache-policy, carved out of --host-memory (CPU-only: out of --reserve-gb) "
                        "(default: none)")
    p.add_argument("--lookahead", type=int, default=0, metavar="N",
                   help="while layer l runs, start reading the offloaded experts layer l+N is predicted to pick (its "
                        "router on layer l's output): disk-tier ones on a worker thread, host-tier ones to the device "
                        "(side stream; CPU-only, a worker thread); tokens unchanged (default 0: off)")
    p.add_argument("--lookahead-from", choices=["output", "attention"], default="output",
                   help="with --lookahead: guess from layer l's output (default: the better guess, made just before "
                        "layer l+1 routes) or from its residual after attention (a whole expert step earlier, a worse "
                        "guess)")
    p.add_argument("--disk-read", choices=["direct", "mmap"], default="direct",
                   help="how the disk tier reads the checkpoint: direct (default: O_DIRECT, the page cache "
                        "bypassed, our caches decide) or mmap (a memory map: the page cache decides, as llama.cpp)")
    p.add_argument("--experts", choices=["auto", "fused", "eager", "grouped"], default="auto",
                   help="how a step's selected experts are computed. auto (default): fused where moe-offload's CPU "
                        "kernels run (a CPU device on which they build; else eager, and the report says why); "
                        "fused: the CPU kernels read each selected expert in its stored format (bf16, FP8 blocks, "
                        "MXFP4 blocks) where it lies, nothing dequantized, float32 accumulation (calls of up to 16 "
                        "rows; longer prefills by the eager loop); eager: the experts class's own loop (the model's "
                        "arithmetic, as transformers); grouped: one inductor-compiled gather-GEMV per projection. "
                        "Tokens are identical to the model loaded with nothing offloaded under the same choice")
    p.add_argument("--expert-compute", choices=["auto", "host", "device"], default="auto",
                   help="where offloaded experts are computed. auto (default): per layer step, as the cost model "
                        "chooses (host compute time from the host's measured read bandwidth and FLOP rate against "
                        "streaming the bytes over the link): a decode step's off-device experts computed by the CPU "
                        "kernels where they lie, a long prefill's sent to the device; on a CPU-only machine the "
                        "device is the host, so as before. host: always on the host (only activations cross the "
                        "link). device: always on the device (their bytes travel)")
    p.add_argument("--link-gbps", type=float, metavar="X",
                   help="host link bandwidth in GB/s (1e9 bytes/s) for the cost model (default: measured on CUDA); "
                        "bench also adds link ms per token from the measured bytes")
    p.add_argument("--host-gbps", type=float, metavar="X",
                   help="the host's read bandwidth in GB/s for the cost model (default: measured once per machine, "
                        "cached in ~/.cache/moe-offload/host-rates.json)")
    p.add_argument("--host-gflops", type=float, metavar="X",
                   help="the host's FLOP rate of the experts kernels in GFLOP/s for the cost model (default: "
                        "measured once per machine, cached)")
    p.add_argument("--measure-host", action="store_true",
                   help="measure the host's rates again for the cost model (they are cached per machine and thread "
                        "count; a BIOS, memory or load change may move them)")
    p.add_argument("--compile", action="store_true",
                   help="decode through the compiled step (torch.compile, static KV cache; CUDA graphs on CUDA): "
                        "the first step compiles (compile_s, reported apart), later ones run the graph")


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
    _device_option(p)
    p.add_argument("--link-gbps", type=float, metavar="X",
                   help="the host -> device link in GB/s for the expert-compute crossover (default: measured on this "
                        "machine's CUDA device; on a CPU-only machine there is no link)")
    p.add_argument("--host-gbps", type=float, metavar="X",
                   help="the host's read bandwidth in GB/s for the crossover (default: measured once, cached)")
    p.add_argument("--host-gflops", type=float, metavar="X",
                   help="the host's experts-kernel FLOP rate in GFLOP/s for the crossover (default: measured once)")
    p.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="greedy decoding with the model loaded into its plan")
    g.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _budget_options(g)
    g.add_argument("--plan", metavar="PLAN.json",
                   help="load into this saved plan (`moe-offload plan MODEL --save PLAN.json`) instead of planning "
                        "from the budget options, which are refused beside it")
    _runtime_options(g)
    g.add_argument("--json", action="store_true", help="print the result as one JSON document")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure offloading arms side by side at one budget (speed and link bytes)")
    b.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    b.add_argument("--arms",
                   help="comma-separated: resident (offload nothing; skipped when it does not fit), declaration, "
                        "sparse-first, frequency (expert by expert from --stats TRACE), explicit:SEG[+SEG...], "
                        "accelerate (transformers + accelerate device_map='auto' at the same budget; rest to disk) "
                        "(default: resident,declaration,sparse-first); "
                        "the arms choose the policy and selectors, so bench takes no --policy / --offload-params; "
                        "with --plan: plan (the saved plan, always measured) and resident beside it at most")
    _budget_options(b, policy_options=False)  # arms choose the policy; an explicit --policy is refused
    b.add_argument("--plan", metavar="PLAN.json",
                   help="measure this saved plan as the arm `plan` (settings read back as for every arm) instead of "
                        "arms at a budget: budget options and placement arms are refused beside it")
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
    b.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch while measuring (default: torch's)")
    b.add_argument("--json", metavar="FILE", help="write the rows as one JSON list to FILE (`-`: stdout)")
    b.add_argument("--plot", metavar="FILE.png", help="write a two-panel chart: tok/s and link bytes per token")
    b.set_defaults(func=cmd_bench)

    add_serve_parser(sub, _budget_options, _runtime_options)

    r = sub.add_parser("replay", help="bytes a placement (and cache) would read for a routing trace, without "
                                      "running the model")
    r.add_argument("model", help="model folder or config.json path (tensor sizes only)")
    r.add_argument("--trace", required=True, metavar="TRACE", help="routing trace whose decode tokens are replayed")
    _budget_options(r, oracle=True)
    r.add_argument("--plan", metavar="PLAN.json", help="replay this saved plan instead of planning from the options")
    r.add_argument("--cache-gb", type=float, metavar="X", help="device-side expert cache of X GiB (default: none)")
    r.add_argument("--cache-policy", metavar="P", help="lru, lfu, ..., or belady (the offline optimum)")
    r.add_argument("--host-cache-gb", type=float, metavar="X",
                   help="host-memory cache of X GiB for disk-tier experts, below the device cache, the same policy; "
                        "carved out of --host-memory (CPU-only: --reserve-gb) as load carves it (default: none)")
    _device_option(r)
    h = r.add_argument_group("host compute prediction (for the machine described; nothing of this one measured)")
    h.add_argument("--expert-compute", choices=["auto", "host", "device"],
                   help="where offloaded experts are computed: host (the CPU kernels where their bytes lie), device "
                        "(their bytes stream over the link, as without host compute), auto (per layer step, the "
                        "cost model's choice). Given, or with any rate below, replay adds the expected ms per token "
                        "(default device)")
    h.add_argument("--link-gbps", type=float, metavar="X", help="host -> device link, GB/s (1e9 bytes/s); a link "
                                                                "means an accelerator (refused with --device cpu)")
    h.add_argument("--host-gbps", type=float, metavar="X", help="host memory read bandwidth of the experts kernels, GB/s")
    h.add_argument("--host-gflops", type=float, metavar="X", help="host FLOP rate of the experts kernels, GFLOP/s")
    h.add_argument("--device-gbps", type=float, metavar="X",
                   help="device memory bandwidth, GB/s: times resident dense weights and device-side experts "
                        "(default: not limiting)")
    h.add_argument("--device-tflops", type=float, metavar="X",
                   help="device FLOP rate on streamed experts, TFLOP/s (default: not limiting)")
    r.add_argument("--json", action="store_true", help="print the result as one JSON document")
    r.set_defaults(func=cmd_replay)

    from ..engines.engine import ENGINES

    x = sub.add_parser("export", help="the command-line options that make vLLM, SGLang or llama.cpp apply the plan "
                                      "(or the closest placement they can)")
    x.add_argument("model", help="model folder or config.json path")
    x.add_argument("--engine", required=True, choices=ENGINES, help="the engine to export for")
    _budget_options(x)
    x.add_argument("--batch", type=int, metavar="N", help="sequences decoded together, for link bytes (default 1)")
    x.add_argument("--plan", metavar="PLAN.json", help="export this saved plan instead of planning from the options")
    x.add_argument("--json", action="store_true", help="print the result as one JSON document")
    x.set_defaults(func=cmd_export)

    pr = sub.add_parser("profile", help="record which experts the routers pick, token by token, as a trace")
    pr.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    pr.add_argument("--out", required=True, metavar="TRACE", help="the trace file to write (JSON Lines, docs/cli.md)")
    pr.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the built-in varied prompts)")
    pr.add_argument("--max-new-tokens", type=int, default=32,
                    help="decode tokens recorded per prompt, each run through the model (default 32)")
    pr.add_argument("--ignore-eos", action="store_true", help="always record --max-new-tokens decode tokens")
    pr.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator when there is one, else cpu)")
    pr.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="the dtype weights are held in "
                    "(default: the checkpoint's)")
    pr.add_argument("--predict", action="store_true",
                    help="decode rows also carry `predicted`: per layer, the experts the look-ahead predictor (the "
                         "layer's router on the previous layer's output) names, for replay to count")
    pr.add_argument("--json", action="store_true", help="print the per-layer skew summary as one JSON document")
    pr.set_defaults(func=cmd_profile)

    t = sub.add_parser("make-tiny", help="write a small random-weight model folder (or one of a released model's "
                                         "shape: --like)")
    from ..tiny.families import FAMILIES
    from ..tiny.like_config import bundled_names

    t.add_argument("dir", help="the folder to write (new, or empty)")
    t.add_argument("--family", metavar="F",
                   help=f"a transformers model family: {', '.join(FAMILIES)} (required unless --like gives it)")
    t.add_argument("--like", metavar="CONFIG",
                   help="take every dimension and field of a released model's config.json: its path, a folder "
                        f"holding it (and its generation_config.json), or a bundled one: {', '.join(bundled_names())}. "
                        "The family is its model_type; options given here override its values (--layers N keeps it "
                        "small; without it all of its layers are written); weights are random, in its dtype, "
                        "quantized as its quantization_config says (gpt-oss: MXFP4)")
    t.add_argument("--layers", type=int, help="decoder layers (default 2; with --like: the released count)")
    t.add_argument("--experts", type=int, help="routed experts per MoE layer (default 8)")
    t.add_argument("--top-k", type=int, help="experts each token is routed to (default 2)")
    t.add_argument("--hidden", type=int, help="hidden size (default 64)")
    t.add_argument("--heads", type=int, help="attention (query) heads (default 4)")
    t.add_argument("--kv-heads", type=int, help="key/value heads (default heads / 2, or heads where that is odd; "
                   "always heads for deepseek_v2/v3 and olmoe)")
    t.add_argument("--head-dim", type=int, help="width of each attention head (default hidden / heads); families "
                   "with a head_dim field (qwen3_moe, mixtral, gpt_oss, ...) take any multiple of 4 whatever the "
                   "hidden size, e.g. 64 or 128 as engines' kernels expect")
    t.add_argument("--expert-ffn", type=int, metavar="N",
                   help="each routed expert's intermediate size (default 1.5 x hidden; Qwen3-30B-A3B: 768)")
    t.add_argument("--dense-ffn", type=int, metavar="N",
                   help="the dense MLP's intermediate size, and the shared expert's where the family sizes it so "
                        "(qwen2_moe) (default 2 x hidden; families without one, such as mixtral and gpt_oss, refuse "
                        "it)")
    t.add_argument("--vocab", type=int, metavar="N",
                   help="vocabulary size: the embedding, the LM head and the tokenizer written, whose ids all lie "
                        "below N (default 512; at least 260)")
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                   help="dtype of the saved (unquantized) weights (default float32; bfloat16 with --quant, as the "
                        "released quantized checkpoints store them; with --like: the config's torch_dtype)")
    t.add_argument("--quant", choices=["fp8", "mxfp4", "none"],
                   help="write the checkpoint quantized, in the released on-disk format: fp8 (e4m3 + "
                        "weight_scale_inv block scales, as DeepSeek-V3 / Qwen3-FP8) or mxfp4 (gpt-oss experts); "
                        "none: unquantized (with --like: even where the config has a quantization_config)")
    t.set_defaults(func=cmd_make_tiny)
    return parser


# The library's errors name Python arguments (`offload_gb=5`, `offload_params`); here the user typed flags.
_FLAGS = {"offload_gb": "--offload-gb", "device_memory_gb": "--device-memory", "reserve_gb": "--reserve-gb",
          "offload_params": "--offload-params", "batch": "--batch", "policy": "--policy", "dtype": "--dtype",
          "cache_gb": "--cache-gb", "cache_policy": "--cache-policy", "host_memory_gb": "--host-memory"}


def _as_flags(message: str) -> str:
    """`offload_gb=5` -> `--offload-gb 5`, `offload_params` -> `--offload-params`.

    A plain word ("batch", "policy") is an argument only when written `word=`; a name with an underscore
    always is (prose has none).
    """
    def flag(m: re.Match) -> str:
        name, eq = m.group(1), m.group(2)
        if not eq and "_" not in name:
            return m.group(0)
        return _FLAGS[name] + (" " if eq else "")

    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b(=?)", flag, message)


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoeOffloadError as exc:
        message = _as_flags(" ".join(str(exc).split()))
        sys.stderr.write(f"error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
