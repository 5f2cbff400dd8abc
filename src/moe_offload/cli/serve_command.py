"""`moe-offload serve`: an OpenAI-compatible server on the model loaded into its plan (serve/).

Everything a user can get wrong is checked before the weights are read: the serve extra installed, the
server's options, the port free (bound first), the chat template file, the KV cache within --reserve-gb.
Then the model is loaded (the loader of generate), the plan's one-screen summary printed, and the server runs
until SIGTERM / Ctrl-C (exit 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import MoeOffloadError

SERVE_MODULES = ("fastapi", "uvicorn", "openai", "prometheus_client")


def _check_extra() -> None:
    import importlib.util

    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MoeOffloadError(f"serve needs {', '.join(missing)}, which are not installed: "
                              "pip install 'moe-offload[serve]'")


def _model_context(folder: Path) -> int:
    from ..model.config import read_config

    config = read_config(folder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "max_position_embeddings", 0) or 2048)


def cmd_serve(args) -> int:
    from ..planning.planner import DEFAULT_RESERVE_GB
    from ..planning.placement import format_bytes
    from ..run.runtime import runtime_of
    from ..serve.server import ServeOptions, bind, check_options, kv_cache_bytes, run
    from .options import model_path
    from .report import print_plan
    from .run_commands import load_for_cli

    _check_extra()
    if args.compile:
        raise MoeOffloadError("serve --compile: the server decodes through transformers' continuous batching, whose "
                              "packed batches the compiled step (static KV cache, one sequence shape) does not take, "
                              "and whose own compiled path decoded the offloaded model 2.5x slower than eager here; "
                              "serve without --compile (on a CPU the decode step already runs the fused kernels, "
                              "--experts auto)")
    folder = model_path(args.model)
    if not (folder / "config.json").is_file():
        raise MoeOffloadError(f"{folder}: no config.json there; give the model folder (config.json, safetensors, "
                              "tokenizer)")
    model_context = _model_context(folder)
    opts = ServeOptions(host=args.host, port=args.port, served_name=args.served_model_name or folder.resolve().name,
                        max_concurrency=args.max_concurrency, max_queue=args.max_queue, api_key=args.api_key,
                        context=args.max_model_len or min(model_context, 4096), shutdown_timeout=args.shutdown_timeout)
    check_options(opts, model_context)
    template = None
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise MoeOffloadError(f"--chat-template {path}: no such file; give a Jinja chat template file")
        template = path.read_text()
    if args.threads is not None:
        if args.threads < 1:
            raise MoeOffloadError(f"--threads {args.threads}: give at least 1 CPU thread")
        import torch

        torch.set_num_threads(args.threads)
    sock = bind(opts.host, opts.port)
    try:
        model, plan, tokenizer = load_for_cli(args)
        if template is not None:
            tokenizer.chat_template = template
        kv = kv_cache_bytes(model, opts)
        if args.device_memory is not None:
            reserve = args.reserve_gb if args.reserve_gb is not None else DEFAULT_RESERVE_GB
            room = int(reserve * 2**30) - (runtime_of(model).cache.capacity_bytes
                                           if runtime_of(model).cache is not None else 0)
            if kv > room:
                raise MoeOffloadError(f"the KV cache for {opts.max_concurrency} sequences of {opts.context} tokens "
                                      f"needs {format_bytes(kv)}, more than the {format_bytes(max(room, 0))} left of "
                                      f"--reserve-gb {reserve}: lower --max-concurrency or --max-model-len, or raise "
                                      "--reserve-gb")
        print_plan(plan)
        rt = runtime_of(model)
        print(f"-- {rt.mechanism}", file=sys.stderr)
        print(f"-- KV cache: {format_bytes(kv)} (paged: {opts.max_concurrency} sequences x {opts.context} tokens); "
              f"chat template: {'yes' if getattr(tokenizer, 'chat_template', None) else 'none (only /v1/completions)'}",
              file=sys.stderr)
        return run(model, plan, tokenizer, sock, opts, announce=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        sock.close()


def add_serve_parser(sub, budget_options, runtime_options) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the model loaded into its plan")
    s.add_argument("model", help="model folder (config.json, safetensors, tokenizer)")
    budget_options(s)
    s.add_argument("--plan", metavar="PLAN.json",
                   help="load into this saved plan instead of planning from the budget options")
    runtime_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--max-concurrency", type=int, default=8, metavar="N",
                   help="sequences decoded together in one batch (default 8); each holds KV cache room for "
                        "--max-model-len tokens")
    s.add_argument("--max-queue", type=int, default=64, metavar="M",
                   help="requests waiting for a free sequence slot; one more is refused with 429 (default 64)")
    s.add_argument("--max-model-len", type=int, metavar="L",
                   help="tokens per sequence, prompt + completion (default: the model's context, at most 4096)")
    s.add_argument("--served-model-name", metavar="NAME", help="the `model` clients name (default: the folder's name)")
    s.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/ (default: none)")
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's own)")
    s.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for torch in the server (default: torch's, which OMP_NUM_THREADS sets)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish before they are cancelled (default 10)")
    s.set_defaults(func=cmd_serve)
