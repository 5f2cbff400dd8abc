"""The runtime: how offloaded weights are read while the model runs, and how many bytes that costs.

Two backends, both real on every machine:

- `uva`: kernels read offloaded weights in place, through device-visible views of pinned
  host memory (storage/host.py). Nothing is copied up front.
- `prefetch`: offloaded dense tensors are copied into reused device buffers before their
  module runs (on a side stream, one module ahead, on CUDA); for routed experts only the
  experts the router selected are staged; offloaded embedding tables are read by rows.

Routed experts are run through an experts function registered with transformers' experts
registry (experts.py), which sees `top_k_index` before any expert weight is touched. It
stages (prefetch) or reads in place (uva) just the selected experts, each from the stack
that holds it when a tensor is split between tiers, then runs the class's own eager forward
on them, so the arithmetic is the model's own. The same function hands the routing of every
call to an optional recorder (`Runtime.recorder`), offloaded or not.

Every backend counts the bytes it reads from the host tier per forward call: that is the
measured link traffic (`LinkCounter`, state.py).

An optional device-side expert cache (`Runtime.cache`, device_cache.py) keeps offloaded experts
that decode steps fetched in device memory carved at load; a hit reads nothing over the link.

`Runtime` builds on `RunState` (state.py: the counters, staging buffers, hook handles and per-call
routing state the readers share); it attaches the readers to the model and runs the per-call hooks.
The prefetch backend's dense ring is dense_prefetch.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .dense_kernel import attach_fp8
from .dense_prefetch import tensor_at
from .read_backend import ReadBackend
from .read_prefetch import PrefetchReads
from .read_uva import UvaReads
from .experts import EXPERTS_IMPL, ExpertsState, is_experts_module, register_experts_function
from .graph_edge import GraphEdges
from ..model.inventory import layer_of, layer_prefix
from .quant_weights import Dequantizer, Reader, byte_split, byte_view, by_module as quant_by_module
from .state import Recorder, RoutedCall, RunState
from ..storage.host import ExpertSplit

if TYPE_CHECKING:
    from .device_cache import DeviceCache



STRATEGIES = (UvaReads, PrefetchReads)
BACKENDS = tuple(cls.name for cls in STRATEGIES)


def backend_named(name: str) -> ReadBackend:
    """The read strategy called `name` ("uva" or "prefetch"); DeviceError for any other."""
    for cls in STRATEGIES:
        if cls.name == name:
            return cls()
    from ..errors import DeviceError

    raise DeviceError(f"unknown backend {name!r}: use uva (host memory read in place) or prefetch (staged copies)")


# The public attribute a loaded model carries (docs/python-api.md); read and set only through these three.
RUNTIME_ATTR = "moe_offload_runtime"


def runtime_of(model: nn.Module, *, required: bool = True) -> "Runtime | None":
    """The runtime moe_offload.load attached to `model`; None (required=False) or an error where it has none."""
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is None and required:
        from ..errors import MoeOffloadError

        raise MoeOffloadError(f"this {type(model).__name__} has no moe-offload runtime: it was not loaded by "
                              "moe_offload.load, or it was closed (load it again)")
    return runtime


def set_runtime(model: nn.Module, runtime: "Runtime | None") -> None:
    """Attach `runtime` to `model` (None: take it off, as closing does)."""
    if runtime is None:
        model.__dict__.pop(RUNTIME_ATTR, None)
    else:
        setattr(model, RUNTIME_ATTR, runtime)


class Runtime(RunState):
    """One loaded model's runtime: its host arena and plan, and the hooks that read offloaded weights (on the
    counters, staging buffers and hook handles of RunState)."""

    def __init__(self, model: nn.Module, *, device: torch.device, backend: str, arena, host_names: dict[str, str],
                 host_tensors: dict[str, torch.Tensor] | None = None, plan=None,
                 splits: dict[str, ExpertSplit] | None = None, recorder: Recorder | None = None,
                 cache: "DeviceCache | None" = None, quant: dict | None = None, disk=None, experts="eager",
                 host_cache=None, lookahead=None, host_compute=None):

        self.reads = backend_named(backend)   # the read strategy (read_uva.py / read_prefetch.py)
        # name -> quant_weights.QuantLayout of every tensor held quantized (values + scales as stored, in its tier);
        # the dequantizer turns them into the compute dtype on the device right before use.
        self.quant = dict(quant or {})
        super().__init__(device=device, backend=backend, recorder=recorder, cache=cache, disk=disk,
                         dequantizer=Dequantizer(device, self.quant) if self.quant else None, experts=experts,
                         host_cache=host_cache, lookahead=lookahead, host_compute=host_compute)
        self.model = model
        self.edges: GraphEdges | None = None   # the streamed experts steps as operators of a compiled step
        self.embed_first = False   # a staged input embedding looked up before the model's forward (_embedded)
        self.arena = arena
        self.host_names = dict(host_names)  # in-memory name -> tier ("host"/"disk"), tracked by name
        # name -> the host-memory tensor behind an offloaded weight (the model may hold a uva view of it)
        self.host_tensors = dict(host_tensors or {})
        self.plan = plan                     # the plan applied, for audits after transforms
        # The plan's accounting (planning/accounting.py): what a staged layer step charges, as replay counts it.
        self.token_bytes = plan.token_bytes() if plan is not None else None
        self._expert_bytes_of: dict[int, torch.Tensor] = {}   # layer -> TokenBytes.expert_host row, on the device
        # name -> layout (resident stack, host ids) of routed-expert tensors split between tiers by expert
        self.splits = dict(splits or {})

    # --- mechanism report ----------------------------------------------------------------
    @property
    def mechanism(self) -> str:
        disk = f"; {self.disk.mechanism}" if self.disk is not None else ""
        quant = self.dequantizer.mechanism if self.dequantizer is not None else ""
        where = f"; {self.host_compute.mechanism}" if self.host_compute is not None else ""
        return f"{self.reads.link_mechanism(self.device)}{disk}{quant}; {self.compute.mechanism}{where}"

    @property
    def host_bytes(self) -> int:
        return self.arena.nbytes

    # --- attach / detach -------------------------------------------------------------------
    def attach(self) -> None:
        """Route offloaded reads through this runtime: experts function, embedding and dense hooks."""

        register_experts_function()
        # Buffers too (DeepSeek's e_score_correction_bias), and every name of a tied tensor: a tied LM head
        # reads the offloaded embedding table in full, through its own module.
        tensors = {**dict(self.model.named_parameters(remove_duplicate=False)), **dict(self.model.named_buffers())}
        host_ids = {id(tensors[n]) for n in self.host_names if n in tensors}
        modules = dict(self.model.named_modules())
        by_module: dict[str, list[str]] = {}
        for name, tensor in tensors.items():
            if id(tensor) not in host_ids:
                continue
            mod_name, _, local = name.rpartition(".")
            by_module.setdefault(mod_name, []).append(local)
        experts_modules = []
        quantized = quant_by_module({n: q for n, q in self.quant.items() if q.reader is Reader.EXPERTS})
        states: dict[str, ExpertsState] = {}   # experts module name -> its state, for the device cache
        served: set[str] = set()   # split tensors an experts function will read
        dense_groups: dict[str, list[str]] = {}
        for mod_name, mod in modules.items():
            locals_ = by_module.get(mod_name)
            if is_experts_module(mod):
                # Every experts module gets a state, offloaded or not: the experts function records routing.
                experts_modules.append(mod)
                # float8 values are gathered as their bytes (byte_view): not every device has float8 index kernels
                offl = {n: byte_view(getattr(mod, n)) for n in (locals_ or [])}
                disk = {n: self.disk.tensors[f"{mod_name}.{n}"] for n in [*mod._parameters, *mod._buffers]
                        if self.disk is not None and f"{mod_name}.{n}" in self.disk.tensors}   # buffers: scales
                served.update(f"{mod_name}.{n}" for n in disk if f"{mod_name}.{n}" in self.splits)
                split = {n: byte_split(self.splits[f"{mod_name}.{n}"]) for n in offl
                         if f"{mod_name}.{n}" in self.splits}
                served.update(f"{mod_name}.{n}" for n in split)
                num = next((getattr(mod, f) for f in ("num_experts", "num_local_experts") if hasattr(mod, f)), None)
                if num is None and offl:  # fused experts: the leading dim of every per-expert tensor
                    name, t = next(iter(offl.items()))
                    num = split[name].num_experts if name in split else t.shape[0]
                if num is None and disk:
                    num = next(iter(disk.values())).shape[0]
                split.update({n: self.splits[f"{mod_name}.{n}"] for n in disk if f"{mod_name}.{n}" in self.splits})
                mod._moe_offload_state = ExpertsState(self, offl, num or 0, split, layer_of(mod_name),
                                                      quant=quantized.get(mod_name, {}), disk=disk)
                states[mod_name] = mod._moe_offload_state
                if disk and self.device.type == "cpu":   # its decode steps may stream: an operator when compiled
                    if self.edges is None:
                        self.edges = GraphEdges()
                    mod._moe_offload_state.edge = self.edges.add(mod._moe_offload_state, mod)
            elif locals_ and isinstance(mod, nn.Embedding):
                self.reads.hook_embedding(self, mod)
            elif locals_:
                # Dense tensors are handled per decoder layer: a layer always runs, while some of its
                # submodules are only read through (Mamba's conv1d weight, read by its mixer, never called).
                group = layer_prefix(mod_name)
                group = mod_name if group is None else group
                rel = mod_name[len(group):].lstrip(".")
                dense_groups.setdefault(group, []).extend(f"{rel}.{n}" if rel else n for n in locals_)
        for group, paths in dense_groups.items():   # read in full per call
            mod = modules[group]
            nbytes = sum(tensor_at(mod, n).numel() * tensor_at(mod, n).element_size() for n in paths)
            self.reads.hook_dense(self, group, mod, paths, nbytes)
        if self.disk is not None:   # dense and embedding tensors on disk: read while their module runs
            self.disk.attach_dense(self, self.model, {n for n, m in modules.items() if is_experts_module(m)})
        if self.dequantizer is not None:   # after the dense hooks: a staged copy is dequantized, not the host one
            in_place = attach_fp8(self.model, self.dequantizer.layouts)   # FP8 Linears the kernel reads as stored
            self.dequantizer.hook_linears(self.model, self.handles, in_place)
        unserved = sorted(set(self.splits) - served)
        if unserved:
            from ..errors import MoeOffloadError

            raise MoeOffloadError(f"{unserved[0]} is split between tiers but no fused experts module reads it; "
                                  "only routed-expert tensors of an experts module can go in part")
        if self.cache is not None:
            self.cache.attach(states, self.device)
        if self.host_cache is not None:
            self.host_cache.attach(states)
        if self.lookahead is not None:
            self.lookahead.attach(self.model, states, self.handles, self)
        if experts_modules:
            self.model.set_experts_implementation(EXPERTS_IMPL)
        self.handles.append(self.model.register_forward_pre_hook(self._top_pre, with_kwargs=True))
        self.handles.append(self.model.register_forward_hook(self._top_post, with_kwargs=True))
        self._experts_modules = experts_modules

    def detach(self) -> None:
        """Remove every hook and cached reference to the weights; attach() builds them afresh."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for mod in getattr(self, "_experts_modules", []):
            mod.__dict__.pop("_moe_offload_state", None)
        if self.edges is not None:
            self.edges.clear()
        self.reads.release()
        if self.cache is not None:   # weights may change before attach(): cached copies would go stale
            self.cache.drop_all()
        if self.host_cache is not None:
            self.host_cache.drop_all()
        self.routes.clear()
        self.routed.clear()
        self.staged_params.clear()

    def host_expert_bytes(self, layer: int) -> torch.Tensor:
        """[E] int64 on the device: each expert's host-tier bytes in routed layer `layer` (TokenBytes.expert_host)."""
        if layer not in self._expert_bytes_of:
            tb = self.token_bytes
            self._expert_bytes_of[layer] = torch.tensor(tb.expert_host[tb.layers.index(layer)], device=self.device)
        return self._expert_bytes_of[layer]

    def close(self) -> None:
        """Stop every worker (look-ahead reads and copies, disk reads), remove every hook, drop the caches and
        staging buffers and release the host arena and the disk tier's files. Idempotent. The model's offloaded
        weights are no longer readable afterwards: loading.handle.Loaded.close empties the model too."""
        if getattr(self, "closed", False):
            return
        self.closed = True
        self.detach()
        if self.lookahead is not None:
            self.lookahead.close()
        if self.host_compute is not None:
            self.host_compute.close()
        if self.disk is not None:
            self.disk.close()
        if self.edges is not None:
            self.edges.close()
        self._staging.clear()
        self.host_tensors.clear()
        if self.arena is not None:
            self.arena.release()

    def invalidate_staging(self, names=None) -> None:
        """Weights were written in place (update_weights): prefetched copies of them are stale, and so are the
        device cache's copies of the experts of `names` (dotted tensor names; None: of every tensor)."""
        self.reads.invalidate()
        if self.cache is not None:
            self.cache.invalidate(names)

    # --- hooks ---------------------------------------------------------------------------
    # The per-call hooks read Python state (the cache's length, the routes to count): under a compiled decode
    # step (compiled.py) they run eagerly, at the graph's edges.
    @torch.compiler.disable
    def _top_pre(self, module, args, kwargs):
        self.routes.clear()  # a call that raised leaves nothing behind for the next one
        self.routed.clear()
        self.counter.discard_pending()
        self.disk_counter.discard_pending()
        self.activation_counter.discard_pending()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self.step_tokens = int(ids.shape[1]) if ids is not None and ids.dim() >= 2 else 1
        # transformers' continuous batching packs its sequences into one row ([1, T]) and names the longest
        # query `max_length_q`: that is the call's new tokens per sequence (1: every sequence decodes one).
        packed = kwargs.get("max_length_q")
        if isinstance(packed, int):
            self.step_tokens = packed
        # transformers 5.24 names the KV cache `cache` (`past_key_values` before): a decode step extends one.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        length = getattr(cache, "get_seq_length", None)
        self._decode = bool(length()) if callable(length) else None
        # The caches serve the calls the counter counts as decode steps (and a trace records as such).
        self.decode_step = self._decode if self._decode is not None else self.step_tokens == 1
        self.cache_step = self.cache is not None and self.decode_step
        if self.cache_step:
            self.cache.policy.begin_step()   # where a step starts, as replay marks it per decoded token
        self.host_cache_step = self.host_cache is not None and self.decode_step
        if self.host_cache_step:
            self.host_cache.policy.begin_step()
        if self.lookahead is not None:
            self.lookahead.settle()
        return self._embedded(args, kwargs) if self.embed_first else None

    def _embedded(self, args, kwargs):
        """The call's arguments with its token ids looked up here, at the step's start, when the model's input
        embedding is staged by rows (the disk tier's or the prefetch backend's table): `inputs_embeds` in place of
        `input_ids`. Done while a compiled decode runs (compiled.decoding sets `embed_first`): the staged lookup
        (reads, hooks) is eager Python, and inside the model's forward it broke the graph where dynamo cannot resume
        (transformers' output-capturing wrapper), so the model's body ran eagerly. The same lookup either way."""
        embed = self.model.get_input_embeddings()
        if not any(embed is m for m in self.staged_embeddings) or kwargs.get("inputs_embeds") is not None:
            return None
        positional = "input_ids" not in kwargs and bool(args)
        ids = args[0] if positional else kwargs.get("input_ids")
        if ids is None:
            return None
        kwargs = {**kwargs, "inputs_embeds": embed(ids)}
        if positional:
            return (None, *args[1:]), kwargs
        return args, {**kwargs, "input_ids": None}

    @torch.compiler.disable
    def _top_post(self, module, args, kwargs, output):
        if self.lookahead is not None:
            self.lookahead.settle()    # wrong guesses' reads end with the call that started them
        for read in self.routes:   # charged on the device from the plan's accounting: no wait here
            read.charge(self)
        self.routes.clear()
        tokens, decode = self.step_tokens, getattr(self, "_decode", None)
        self.counter.end_call(tokens, decode)
        self.disk_counter.end_call(tokens, decode)
        self.activation_counter.end_call(tokens, decode)
        if self.recorder is not None:
            routed = {layer: index.cpu() for layer, index in sorted(self.routed.items())}
            self.routed.clear()
            self.recorder(RoutedCall(tokens, self.counter.decode[-1], routed))
