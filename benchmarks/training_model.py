"""The tokenizer and the Qwen3-MoE of benchmarks/train_tiny.py: building them, training the model (with a
per-layer router load-balancing loss) and measuring its loss and routing skew on a token stream."""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from training_settings import Settings

EOT = "<|endoftext|>"   # the one special token: document separator, EOS and padding (as Qwen's tokenizers do)

console = Console(highlight=False)


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
