"""`make model`: train a small Qwen3-MoE on local text so that its routers route like real ones.

Random weights route almost uniformly, which hides every effect that routing-aware placement
is about. This script trains a real transformers `Qwen3MoeForCausalLM` (4 layers x 32 experts,
top-2, hidden 128: 4.4 M parameters, 71% of them routed experts) on text every machine with
Python has, in about 8 minutes on 2 CPU cores (measured: 470 s of training, 1 thread, on a VM
shared with other jobs), and saves it in Hugging Face format with its tokenizer:

* training text: the source of the Python standard library (code, comments and docstrings),
  found with `sysconfig`, files in sorted order; one file in ten (chosen by a hash of its
  relative path, so the choice does not depend on which files a Python version has) is held
  out as *unseen code of the training kind*;
* held-out text of a different kind: English prose from /usr/share/doc (README, NEWS,
  changelog and copyright files, gzipped or not; deduplicated, so the licence texts that
  hundreds of packages repeat count once). A plain Debian/Ubuntu image always keeps the
  copyright files; when fewer than MIN_PROSE paragraphs exist, the script says so and uses
  the docstrings of the held-out stdlib modules instead (English, but a kind the training
  text contains);
* tokenizer: a byte-level BPE of 4096 tokens trained on the training text (`tokenizers`),
  saved as a `PreTrainedTokenizerFast`.

A per-layer router load-balancing loss is on with the usual small coefficient (0.01): enough
that no expert dies, small enough that routing stays skewed. After training the script
measures, on the held-out text, the loss and each layer's routing skew (the share of routed
picks served by the busiest 10% of experts, 4 of 32; uniform routing gives 12.5%), prints
sample generations, and writes:

  MODEL/config.json, model.safetensors, generation_config.json, tokenizer files
  MODEL/train_info.json    settings, their hash, timings, losses, skew, data provenance
  MODEL/eval_texts.json    prompts for benchmarks: training-domain code, held-out code,
                           held-out prose (the split used here, so benchmarks cannot mix them)

The folder is a cache: a second run with the same settings (same hash) does nothing, a run
with other settings retrains. It is written next to its final place and renamed into it, so
an interrupted run leaves nothing half-made. The test suite never needs this model.

The pieces live beside this script: the text and the rules that choose it in training_data.py,
the settings and their hash (the cache key) in training_settings.py, the tokenizer, the model,
its training loop and its evaluation in training_model.py; this script runs them and writes the folder.

Usage: .venv/bin/python benchmarks/train_tiny.py [--out models/trained-qwen3moe] [--steps N] [--threads T] [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from rich.console import Console

from training_data import (DATA_RULES, DOC_ROOT, MIN_PROSE, code_chunks, doc_prose, docstring_prose, is_heldout,
                           spread, stdlib_files)
from training_model import EOT, build_model, build_tokenizer, encode, evaluate, train
from training_settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "trained-qwen3moe"

console = Console(highlight=False)


# --- the run ------------------------------------------------------------------------------

def cached(out: Path, digest: str) -> bool:
    info = out / "train_info.json"
    needed = ("config.json", "model.safetensors", "tokenizer.json", "eval_texts.json")
    if not info.is_file() or not all((out / n).is_file() for n in needed):
        return False
    return json.loads(info.read_text()).get("settings_hash") == digest


def make(out: Path, s: Settings, threads: int) -> None:
    torch.manual_seed(s.seed)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    files = stdlib_files()
    train_files = [f for f in files if not is_heldout(f[0], s.heldout_every)]
    held_files = [f for f in files if is_heldout(f[0], s.heldout_every)]
    prose, prose_files = doc_prose()
    if len(prose) >= MIN_PROSE:
        prose_source = f"English paragraphs of {prose_files} README/NEWS/changelog/copyright files under {DOC_ROOT}"
    else:
        console.print(f"[yellow]only {len(prose)} English paragraphs under {DOC_ROOT} (at least {MIN_PROSE} "
                      "are needed for a held-out evaluation): using the docstrings of the held-out stdlib "
                      "modules as held-out prose instead. They are English, but docstrings also appear in "
                      "the training text, so this evaluation is less far from training.")
        prose = docstring_prose(held_files)
        prose_source = f"docstring paragraphs of {len(held_files)} held-out stdlib modules (fallback)"
    console.print(f"training text: {len(train_files)} stdlib files, {sum(len(t) for _, t in train_files) / 1e6:.1f} MB "
                  f"(Python {sys.version.split()[0]}); held out: {len(held_files)} stdlib files, "
                  f"{len(prose)} prose paragraphs ({prose_source})")

    tokenizer = build_tokenizer([t for _, t in train_files], s)
    train_stream = encode(tokenizer, [t for _, t in train_files])
    held_stream = encode(tokenizer, [t for _, t in held_files])
    prose_stream = encode(tokenizer, spread(prose, 2000))   # plenty for 32 evaluation windows
    t_data = time.perf_counter() - t0
    model = build_model(s, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    console.print(f"{len(train_stream) / 1e6:.2f} M training tokens ({t_data:.0f} s to read and tokenize); "
                  f"model: {n_params / 1e6:.2f} M parameters, {n_expert / n_params:.0%} routed experts; "
                  f"{s.steps} steps x {s.batch} x {s.seq_len} tokens")

    t1 = time.perf_counter()
    losses = train(model, train_stream, s)
    t_train = time.perf_counter() - t1
    evals = {name: evaluate(model, stream, s) for name, stream in
             (("train", train_stream), ("heldout_code", held_stream), ("heldout_prose", prose_stream))}
    report(evals)
    samples = sample(model, tokenizer)

    texts = {"train_domain_code": spread(code_chunks(train_files, s.prompt_chars), s.eval_prompts),
             "heldout_code": spread(code_chunks(held_files, s.prompt_chars), s.eval_prompts),
             "heldout_prose": [p[:s.prompt_chars] for p in spread(prose, s.eval_prompts)],
             "prose_source": prose_source}
    info = {"settings": asdict(s), "settings_hash": s.digest(), "data_rules": DATA_RULES,
            "python": sys.version.split()[0], "torch": torch.__version__, "threads": threads,
            "train_files": len(train_files), "heldout_files": len(held_files), "prose_source": prose_source,
            "train_tokens": len(train_stream), "params": n_params, "routed_expert_params": n_expert,
            "data_seconds": round(t_data, 1), "train_seconds": round(t_train, 1),
            "final_train_loss": sum(losses[-50:]) / len(losses[-50:]), "eval": evals, "samples": samples}
    save(out, model, tokenizer, info, texts)
    console.print(f"wrote {out} in {time.perf_counter() - t0:.0f} s (training {t_train:.0f} s)")


def report(evals: dict) -> None:
    from rich.table import Table

    any_eval = next(iter(evals.values()))
    t = Table(title=f"routing skew: share of picks served by the busiest {any_eval['busiest_experts']} experts "
                    f"of each layer (uniform: {any_eval['uniform_share']:.1%})", title_justify="left")
    t.add_column("text")
    t.add_column("loss", justify="right")
    for i in range(len(any_eval["busiest_share"])):
        t.add_column(f"layer {i}", justify="right")
    t.add_column("never picked", justify="right")
    for name, ev in evals.items():
        t.add_row(name, f"{ev['loss']:.2f}", *(f"{x:.1%}" for x in ev["busiest_share"]),
                  "/".join(map(str, ev["never_picked"])))
    console.print(t)


@torch.no_grad()
def sample(model, tokenizer) -> dict:
    out = {}
    torch.manual_seed(0)
    for prompt in ('def read_config(path):\n    """', "The package provides"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        # Greedy is what `moe-offload generate` does; a tiny model's greedy text soon repeats
        # itself, so a sampled continuation shows better what it learned.
        for how, kwargs in (("greedy", dict(do_sample=False)),
                            ("sampled (temperature 0.8, top-k 40)", dict(do_sample=True, temperature=0.8, top_k=40))):
            gen = model.generate(ids, max_new_tokens=60, pad_token_id=tokenizer.pad_token_id, **kwargs)
            out[f"{how}: {prompt}"] = text = tokenizer.decode(gen[0, ids.shape[1]:])
            console.rule(f"{how}, after {prompt!r}")
            console.print(prompt + text, markup=False)
    return out


def save(out: Path, model, tokenizer, info: dict, texts: dict) -> None:
    from transformers import GenerationConfig

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # Inference does not need router logits; a loaded model should not compute the aux loss.
    model.config.output_router_logits = False
    model.set_experts_implementation("eager")   # the transformers default, what every loader expects
    eot = tokenizer.convert_tokens_to_ids(EOT)
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=eot, pad_token_id=eot,
                                               bos_token_id=eot, max_new_tokens=64)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "eval_texts.json").write_text(json.dumps(texts, indent=1))
    (partial / "train_info.json").write_text(json.dumps(info, indent=1))
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, help="override the step count (a short development run)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2); 1 is faster where other jobs share the cores: measured "
                             "on this 2-core VM under load, 4.9 s a step with 2 threads against 0.57 s with 1")
    parser.add_argument("--force", action="store_true", help="retrain even when the cached model matches")
    args = parser.parse_args()
    s = Settings() if args.steps is None else replace(Settings(), steps=args.steps)
    out = args.out.resolve()
    if out.exists() and not (out / "train_info.json").is_file() and any(out.iterdir()):
        console.print(f"error: {out} exists and was not made by this script (no train_info.json); "
                      "it is never overwritten. Fix: remove it or pass another --out.")
        return 2
    if not args.force and cached(out, s.digest()):
        console.print(f"{out} is up to date (settings hash {s.digest()}); --force retrains")
        return 0
    make(out, s, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
