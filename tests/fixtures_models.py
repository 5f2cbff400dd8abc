"""Tiny model folders, budgets and reference runs shared by test_loader.py and test_runtime.py.

Imported explicitly (not a conftest). Every model is written by `moe_offload.tiny.make.make_tiny`
at the sizes below; nothing is fetched from a hub.

Sizes (float32, 4 bytes per element; hidden 32, 2 layers, E=6 experts, top-k 2, vocab 512):

    model.embed_tokens.weight      (512, 32)      65536 B   embedding (density 1/512)
    mlp.experts.gate_up_proj       (6, 96, 32)    73728 B   routed expert, 12288 B per expert
    mlp.experts.down_proj          (6, 32, 48)    36864 B   routed expert,  6144 B per expert
    lm_head.weight                 (512, 32)      65536 B

so one MoE layer holds 110592 B of routed experts (18432 B per expert). gpt-oss stores the
same matrices transposed ((6, 32, 96), (6, 48, 32)) plus per-expert biases.
"""

from __future__ import annotations

import torch
import transformers

from moe_offload.planning.placement import GiB
from moe_offload.tiny import families as tiny
from moe_offload.tiny.families import AUTO_CLASSES
from moe_offload.tiny.make import make_tiny

FAMILIES = tiny.FAMILIES  # every family make_tiny writes
SIZES = dict(layers=2, experts=6, top_k=2, hidden=32)
EXPERTS, TOP_K = SIZES["experts"], SIZES["top_k"]
BACKENDS = ("uva", "prefetch")
# Budget arms (see `budgets`).
ARMS = ("resident", "sparse-first", "sparse-partial", "declaration", "all")


def make_models(tmp_path_factory, families=FAMILIES) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(root / f, family=f, **SIZES) for f in families}


def auto_class(family: str):
    return getattr(transformers, AUTO_CLASSES[family])


def reference_model(folder, family: str):
    """The plain transformers model: fp32, CPU, eager experts."""
    model = auto_class(family).from_pretrained(folder, experts_implementation="eager", dtype=torch.float32,
                                               local_files_only=True)
    # Inference weights, as moe_offload loads them: on the CPU torch picks another convolution kernel when a
    # weight requires grad (Jamba's Mamba conv1d then differs by one ulp), even under no_grad.
    model.requires_grad_(False)
    return fresh_allocations(model).eval()


def fresh_allocations(model):
    """Every parameter and buffer copied into a fresh allocation of its own, as moe_offload.load makes them.

    from_pretrained leaves weights in memory-mapped safetensors pages, aligned only as the file's header
    length happens to place them. BLAS picks its kernels (and so its summation order) by alignment, so a
    reference read from the mapping differs from the same weights in fresh memory by an ulp on some CPUs
    (AMD EPYC, AVX2 paths) and not on others. With both sides in fresh 64-byte aligned allocations the
    comparison is exact on every CPU, BLAS build and thread count. Tied tensors stay tied.
    """
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in seen:
                    data = t.detach().clone(memory_format=torch.contiguous_format)
                    seen[id(t)] = torch.nn.Parameter(data, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else data
                table[name] = seen[id(t)]
    return model


def prompt_ids(folder, n: int = 12) -> torch.Tensor:
    """The first `n` tokens of a fixed prompt, by the model's own tokenizer: [1, n]."""
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tok("The harbour master counted seven ships leaving before the storm reached the coast",
              return_tensors="pt").input_ids[:, :n]
    assert ids.shape == (1, n)
    return ids


def run(model, ids: torch.Tensor, new_tokens: int = 6, *, ignore_eos: bool = False):
    """(greedy tokens [1, n+new], per-step logits [new, V], prefill logits [1, n, V]). `ignore_eos`: decode all
    `new_tokens` past an EOS (as the engines' ignore_eos does: EOS is not masked, only not a stop)."""
    mask = torch.ones_like(ids)
    stop = {"eos_token_id": None} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **stop)
        prefill = model(input_ids=ids, attention_mask=mask).logits
    return out.sequences, torch.cat(out.logits), prefill


def _is_dense(t) -> bool:
    return t.role not in ("routed_expert", "embedding")


def budgets(plan0) -> dict[str, dict]:
    """Budget options per arm, from the byte sizes of a zero-budget plan `plan0` (no tier taken from it).

    resident        offload_gb=0
    sparse-first    every routed expert and the embedding, plus a third of the dense bytes
    sparse-partial  the embedding plus half the routed-expert bytes: some experts stay resident
    declaration     declaration order up to and including the first routed-expert tensor (exactly)
    all             the whole model
    """
    ts = plan0.tensors
    sparse = sum(t.bytes for t in ts if not _is_dense(t))
    dense = sum(t.bytes for t in ts if _is_dense(t))
    routed = sum(t.bytes for t in ts if t.role == "routed_expert")
    embed = sum(t.bytes for t in ts if t.role == "embedding")
    upto_first_expert = 0
    for t in ts:
        upto_first_expert += t.bytes
        if t.role == "routed_expert":
            break
    # x / 2**30 is exact in floating point, so the planner's ceil(x * 2**30) gives back these byte counts.
    return {
        "resident": dict(offload_gb=0),
        "sparse-first": dict(offload_gb=(sparse + dense // 3) / GiB),
        "sparse-partial": dict(offload_gb=(embed + routed // 2) / GiB),
        "declaration": dict(offload_gb=upto_first_expert / GiB, policy="declaration"),
        "all": dict(offload_gb=plan0.total_bytes / GiB),
    }


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def slice_bytes(planned) -> int:
    """Bytes of one expert's slice of a fused routed-expert tensor [E, ...]."""
    assert planned.shape[0] == EXPERTS, planned
    return planned.bytes // EXPERTS



TIED_VOCAB = 96
TIED_IDS = torch.tensor([[1, 5, 17, 33, 70, 90, 11, 42, 3, 64]])


def make_tied(folder):
    """A Qwen3-MoE checkpoint with tie_word_embeddings=True (make_tiny writes untied models).

    hidden 32, 2 layers, 4 experts top-2, vocab 96: the tied table is (96, 32) = 12288 B.
    """
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=TIED_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def load(folder, **kw):
    """moe_offload.load on the CPU (the default device is the accelerator when there is one)."""
    import moe_offload as mo

    return mo.load(folder, **{"device": "cpu", **kw})


def subset_plan(folder, ids_of):
    """A plan of `folder` with the experts `ids_of(t)` of every routed-expert tensor t on the host (None: the
    tensor stays resident), any subset, as saved and read back."""
    import dataclasses

    import moe_offload as mo
    from moe_offload.planning.placement import Plan

    plan = mo.plan(folder, offload_gb=0)
    tensors = []
    for t in plan.tensors:
        ids = ids_of(t) if t.role == "routed_expert" else None
        if ids is not None:
            t = dataclasses.replace(t, tier="host", host_experts=len(ids), host_expert_ids=tuple(ids))
        tensors.append(t)
    return Plan.from_json(dataclasses.replace(plan, tensors=tuple(tensors)).to_json())


def replay_own_trace(model, plan, folder, path, tokens: int):
    """Record `tokens` decode tokens of `model` (a prompt of `folder`'s tokenizer) into a trace at `path`, and replay
    that trace under `plan`: what the accounting says the generation read (replay.ReplayResult)."""
    from moe_offload.formats.traces import TraceWriter, read_trace
    from moe_offload.loading.loader import load_tokenizer
    from moe_offload.measure.profile import record, trace_header
    from moe_offload.routing.replay import replay

    with TraceWriter(path, trace_header(plan, "test")) as writer:
        record(model, load_tokenizer(folder), ["The storm reached the coast"], writer, max_new_tokens=tokens,
               ignore_eos=True)
    return replay(plan, read_trace(path))
