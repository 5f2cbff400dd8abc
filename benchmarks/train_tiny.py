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

Usage: .venv/bin/python benchmarks/train_tiny.py [--out models/trained-qwen3moe] [--steps N] [--threads T] [--force]
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "trained-qwen3moe"
DOC_ROOT = Path("/usr/share/doc")
EOT = "<|endoftext|>"   # the one special token: document separator, EOS and padding (as Qwen's tokenizers do)
MIN_PROSE = 64          # fewer held-out prose paragraphs than this and the evaluation would be noise
# Bump when the text-selection rules below change: the cached model then no longer matches them.
DATA_RULES = 1

console = Console(highlight=False)


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    vocab_size: int = 4096
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    experts: int = 32
    top_k: int = 2
    expert_ffn: int = 64
    seq_len: int = 256
    batch: int = 8
    # 1000 steps x 2048 tokens (2 M tokens, ~2/3 of one pass over the training text): measured
    # 0.47 s a step, 469 s in all, with one thread on a 2-core VM that other jobs were using.
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.01
    # Per-layer Switch load-balancing loss (see balance_loss), at the usual Switch coefficient.
    aux_loss_coef: float = 0.01
    heldout_every: int = 10   # 1 stdlib file in 10 is held out
    eval_prompts: int = 200   # per kind, in eval_texts.json
    prompt_chars: int = 600

    def digest(self) -> str:
        blob = json.dumps({"settings": asdict(self), "data_rules": DATA_RULES}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- text ---------------------------------------------------------------------------------

def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's own .py files, in sorted order.

    Tests, third-party packages and the build-specific sysconfig data are left out: they are
    not the library's prose-and-code, and the last differs from machine to machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip_dirs & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def is_heldout(rel: str, every: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % every == 0


_DOC_NAME = re.compile(r"^(readme|news|changelog|changes|copyright|authors|thanks)", re.IGNORECASE)
_CHANGELOG_NOISE = re.compile(r"^\s*(-- .*<.*>|\S+ \(.*\) .*; urgency=\S+)\s*$")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs that read as English prose, whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.splitlines() if not _CHANGELOG_NOISE.match(ln)]
        para = " ".join(" ".join(lines).split())
        words = para.split()
        if len(words) < 25 or len(para) > 4000:
            continue
        letters = sum(c.isalpha() or c == " " for c in para)
        # Prose is nearly all letters and spaces; licences' field lists, code and file lists are not.
        if letters / len(para) >= 0.9:
            out.append(para)
    return out


def doc_prose() -> tuple[list[str], int]:
    """Distinct English paragraphs from /usr/share/doc and the number of files they came from."""
    seen: set[str] = set()
    paras: list[str] = []
    files = 0
    if not DOC_ROOT.is_dir():
        return [], 0
    for dirpath, dirnames, filenames in os.walk(DOC_ROOT):   # symlinked package folders are not followed
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not _DOC_NAME.match(name) or path.stat().st_size > 2_000_000:
                continue
            try:
                raw = gzip.open(path).read() if name.endswith(".gz") else path.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            found = [p for p in _paragraphs(text) if p not in seen]
            seen.update(found)
            paras.extend(found)
            files += bool(found)
    return paras, files


def docstring_prose(files: list[tuple[str, str]]) -> list[str]:
    """The fallback held-out prose: docstring paragraphs of the given modules."""
    out = []
    for _, src in files:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.extend(_paragraphs(doc))
    return out


def code_chunks(files: list[tuple[str, str]], chars: int) -> list[str]:
    """Consecutive pieces of about `chars` characters, cut at line ends."""
    out = []
    for _, src in files:
        piece = ""
        for line in src.splitlines(keepends=True):
            piece += line
            if len(piece) >= chars:
                if piece.strip():
                    out.append(piece)
                piece = ""
    return out


def spread(items: list[str], n: int) -> list[str]:
    """n items chosen by content hash: deterministic, and spread over every source file."""
    return sorted(items, key=lambda s: hashlib.sha1(s.encode()).hexdigest())[:n]


# --- tokenizer and model ------------------------------------------------------------------

def build_tokenizer(texts: list[str], s: Settings):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level: any text (prose, code, UTF-8 of every script) encodes without <unk>.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=s.vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, bos_token=EOT,
                                   model_max_length=2 * s.seq_len)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """One long stream of token ids: each text preceded by the separator, as training sees it."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def build_model(s: Settings, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.hidden // s.heads,
        intermediate_size=4 * s.hidden,   # unused: every layer is an MoE layer (decoder_sparse_step=1)
        moe_intermediate_size=s.expert_ffn, num_experts=s.experts, num_experts_per_tok=s.top_k,
        norm_topk_prob=True, max_position_embeddings=2 * s.seq_len, tie_word_embeddings=False,
        # The balancing loss is computed here per layer (balance_loss), not by transformers.
        output_router_logits=False, router_aux_loss_coef=0.0,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, dtype="float32",
    )
    # grouped_mm for training: the eager per-expert loop's backward zero-fills a full [E, ...]
    # gradient for every expert slice it indexes (28% of a step, profiled). Saved as eager.
    return AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm")


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[i:i + length] for i in starts.tolist()])


def lr_at(step: int, s: Settings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    done = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))   # cosine down to 10%


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer load balancing, per layer, averaged: 1.0 when routing is uniform.

    transformers' load_balancing_loss_func pools the pick counts of all layers before taking
    the product, so an expert that is dead in one layer and busy in another costs nothing;
    in a trial run that left a third of the experts of layers 1-3 never picked. Balancing each
    layer on its own keeps every expert in use.
    """
    per_layer = []
    for logits in router_logits:                       # logits: [tokens, E]
        probs = logits.float().softmax(dim=-1)
        picks = probs.topk(top_k, dim=-1).indices      # [tokens, k]
        n_experts = probs.shape[-1]
        share = torch.bincount(picks.reshape(-1), minlength=n_experts).float() / picks.numel()
        per_layer.append(n_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(per_layer).mean()


def train(model, stream: torch.Tensor, s: Settings) -> list[float]:
    gen = torch.Generator().manual_seed(s.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    model.train()
    losses = []
    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=s.steps, loss="-")
        for step in range(s.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s)
            x = windows(stream, s.batch, s.seq_len, gen)
            out = model(input_ids=x, labels=x, output_router_logits=True)
            aux = balance_loss(out.router_logits, s.top_k)
            (out.loss + s.aux_loss_coef * aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())   # the language-model part alone
            bar.update(task, advance=1, loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            if not console.is_terminal and (step + 1) % 100 == 0:   # a log file sees no live bar
                console.print(f"step {step + 1}/{s.steps}: loss {sum(losses[-100:]) / 100:.3f}")
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, s: Settings, n_windows: int = 32) -> dict:
    """Mean next-token loss and per-layer routing skew over fixed windows of a token stream."""
    gen = torch.Generator().manual_seed(s.seed + 1)
    x = windows(stream, n_windows, s.seq_len, gen)
    counts = [torch.zeros(s.experts, dtype=torch.long) for _ in range(s.layers)]
    handles = []
    for i, layer in enumerate(model.model.layers):
        # The router returns (logits, weights, top-k indices); count the indices it picked.
        def hook(_mod, _inp, out, i=i):
            counts[i] += torch.bincount(out[2].reshape(-1), minlength=s.experts)
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        losses = [model(input_ids=x[j:j + 8], labels=x[j:j + 8], output_router_logits=False).loss.item()
                  for j in range(0, n_windows, 8)]
    finally:
        for h in handles:
            h.remove()
    busiest = max(1, math.ceil(s.experts / 10))   # as moe_offload.formats.traces.skew_summary counts it
    skew = [c.sort(descending=True).values[:busiest].sum().item() / c.sum().item() for c in counts]
    return {"loss": sum(losses) / len(losses), "busiest_share": skew, "busiest_experts": busiest,
            "uniform_share": busiest / s.experts, "never_picked": [int((c == 0).sum()) for c in counts]}


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
