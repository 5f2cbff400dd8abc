"""The decode step compiled: transformers' own compiled-generate path, with the runtime's reads at its edges.

`generate(..., cache_implementation="static", compile_config=...)` is how transformers compiles decoding:
the prefill runs eagerly, every later step through `torch.compile` of the model's call over a static KV
cache (fixed shapes, so one graph serves every step). `compile_kwargs` gives those arguments for a loaded
model: inductor, `dynamic=False`, not fullgraph; on CUDA `mode="reduce-overhead"` (CUDA graphs: the
resident part and the uva reads, which are kernels reading mapped host memory, are replayed as one graph
per step).

Where the graph breaks (routing is data-dependent):

- the runtime's per-call hooks (runtime.py `_top_pre` / `_top_post`: the cache's length, the uva routes
  counted with `torch.unique`) run eagerly at the start and end of each step;
- an experts module whose selected experts must be gathered (split between tiers, the prefetch backend, the
  device cache, the disk tier, quantized: experts.py `ExpertsState.gather`) breaks the graph at its
  gather, which runs eagerly; the compute after it is traced again;
- the disk tier's dense reads;
- an offloaded embedding table's staging hooks (state.py `hook_staged_embedding`) run eagerly before the graph:
  the runtime's hook looks the call's ids up before the model's forward and calls it with `inputs_embeds`
  (`decoding`). Inside the forward, the lookup broke the graph where dynamo cannot resume (transformers'
  output-capturing wrapper), and the model's body ran eagerly: at 55% of Qwen3-30B-A3B's layer x 8 (its embedding
  on the disk tier), two threads, compiled and eager steps alternated in one process (ITL p50 of 20 tokens):
  92-100 ms compiled against 100-104 eager before (3 pairs), 78-85 against 84-108 after (5 pairs).

Not a break: a CPU-only disk-tier decode step with the fused kernels streams its experts (streamed.py
`streamed_step`: reader threads, each expert computed as its rows land) inside one opaque node of the graph, the
runtime's own operator (graph_edge.py), so the layers around it stay one graph (a break there, inside the loop
over the layers, made dynamo run the model's body eagerly).

Resident experts and whole host tensors under uva stay inside the graph, computed by the same grouped
kernels as grouped.py (or the eager loop, traced, with experts="eager"). Counting is unchanged: every
byte is counted by the same hooks and gathers, eagerly, so link and disk bytes and cache hits are the
uncompiled run's. `decoding(model)` is the context compiled generate calls run in (the recompile limit
raised to cover every layer's frame). The first decode step pays the compilation; `compile_s` (measure/timing.py) is that
step's time beyond a warm step's. torch caches compiled kernels on disk (inductor's FX graph cache, under
its cache directory), so a second process compiles faster.
"""

from __future__ import annotations

import contextlib

import torch

from .grouped import check_kernels
from .runtime import runtime_of
from .transformers_compat import compile_on_every_device

# Families whose decoding cache is not a static KV cache transformers can compile (state-space / linear
# attention layers keep their own recurrent state).
NOT_COMPILABLE = {"jamba": "Mamba layers", "qwen3_next": "Gated DeltaNet linear-attention layers"}


def check_compile(model) -> None:
    """Raise MoeOffloadError when this model's decode step cannot be compiled here, with why and the fix."""
    from ..errors import MoeOffloadError

    kind = getattr(model.config, "model_type", "")
    if kind in NOT_COMPILABLE:
        raise MoeOffloadError(f"--compile: {kind} decodes with {NOT_COMPILABLE[kind]}, whose cache transformers "
                              "does not compile with a static KV cache; run without --compile")
    check_kernels(runtime_of(model).device, "--compile")


def compile_config(device: torch.device):
    """transformers' CompileConfig for the decode step on `device`."""
    from transformers import CompileConfig

    cfg = CompileConfig(fullgraph=False, dynamic=False, backend="inductor",
                        mode="reduce-overhead" if device.type == "cuda" else "default")
    compile_on_every_device(cfg)   # by itself transformers compiles the decode step on accelerators only
    return cfg


def compile_kwargs(model) -> dict:
    """The keyword arguments of `model.generate` that decode through the compiled step."""
    check_compile(model)
    return {"cache_implementation": "static", "compile_config": compile_config(runtime_of(model).device)}


@contextlib.contextmanager
def decoding(model):
    """The context a compiled generate runs in: dynamo may compile each decoder layer's frame apart (a gather
    breaks the graph inside it, and its layer index is guarded on), so the recompile limit (8 by default, past
    which frames run uncompiled with only a warning) is raised to cover every layer, for these calls only. An input
    embedding staged by rows is looked up by the runtime's hook before the model's forward (runtime.py
    `_embedded`): the forward is then called with `inputs_embeds` in place of `input_ids`, so hooks a user put on
    the model see them so, in these calls only."""
    layers = getattr(model.config, "num_hidden_layers", None) or getattr(
        getattr(model.config, "text_config", None), "num_hidden_layers", 0) or 0
    rt = runtime_of(model)
    # Frames are code objects shared by every model of a class in the process: each load's graphs add entries, and
    # past the limit a frame runs uncompiled (only a warning), so leave room for several loads.
    with torch._dynamo.config.patch(recompile_limit=8 * layers + 64):
        rt.embed_first = True
        try:
            yield
        finally:
            rt.embed_first = False


def compile_seconds(step_s: list[float]) -> float:
    """What compiling cost: the first decode step's time beyond the median of the later ones (0 with no steps)."""
    if not step_s:
        return 0.0
    rest = sorted(step_s[1:])
    warm = rest[len(rest) // 2] if rest else 0.0
    return max(step_s[0] - warm, 0.0)
