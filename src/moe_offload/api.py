"""The Python API's functions: plan a model, load it into its plan, audit it, transform its weights.

The package face (`moe_offload/__init__.py`) hands these on; `measure/` and `cli/` call them here.
"""

from __future__ import annotations

from typing import Sequence

from .planning.placement import Plan


def load(model_dir, *, device=None, backend: str | None = None, plan: "Plan | str | None" = None,
         dtype: str | None = None, progress: bool = False, cache_gb: float | None = None,
         cache_policy: str | None = None, experts: str | None = None, host_cache_gb: float | None = None,
         lookahead: int = 0, lookahead_from: str = "output", disk_read: str = "direct",
         expert_compute: str = "auto", link_gbps: float | None = None, host_gbps: float | None = None,
         host_gflops: float | None = None, measure_host: bool = False, **budget):
    """Build a model from a local checkpoint straight into its plan; returns (model, plan), as a `Loaded` handle:
    `model, plan = mo.load(...)` as always, or `with mo.load(...) as loaded:` (`loaded.model`, `loaded.plan`,
    `loaded.runtime`), which closes it at the end: worker threads stopped, hooks removed, host arena and caches
    freed, the model emptied (loading/handle.py). `loaded.close()` does the same at any time.

    Budget options as for `plan` (offload_gb, device_memory_gb, reserve_gb, host_memory_gb,
    cpu_only, policy, offload_params, batch), or `plan=` a Plan / saved plan JSON. The model is an ordinary
    transformers model (`model.generate(...)` works) with a `moe_offload_runtime` attribute
    that says which mechanism is used and counts the bytes read over the link.
    `cache_gb` (with `cache_policy`): a device-side cache of that many GiB for the offloaded routed
    experts that decode steps fetch (`model.moe_offload_runtime.cache.stats()`: hits and misses).
    `experts`: "eager" (default: the experts class's own loop, the model's arithmetic) or "grouped" (the selected
    experts of a call in one fused gather-GEMV kernel per projection; bit-identical to the same model loaded with
    nothing offloaded and experts="grouped").
    `host_cache_gb`: a host-memory cache of that many GiB for the routed experts the plan leaves on disk (the same
    `cache_policy`), carved out of host_memory_gb (CPU-only: out of reserve_gb); `...runtime.host_cache.stats()`.
    `lookahead`: N > 0 starts reading the offloaded experts (disk and host tier) layer l + N is predicted to pick
    (its router on layer l's output) while layer l runs; tokens unchanged (`...runtime.lookahead.stats(tokens)`).
    `lookahead_from`: "output" (default) or "attention" (guesses from layer l's residual after attention, before its
    MoE: a whole expert step earlier, a worse guess).
    `disk_read`: "direct" (default: O_DIRECT, our caches decide) or "mmap" (the page cache decides, as llama.cpp).
    `expert_compute`: "auto" (default: per layer step, the cost model chooses whether offloaded experts are computed
    on the host, where their bytes lie, or travel to the device; on a machine without a link, as CPU-only, they are
    read where they lie as before), "host" or "device"; `link_gbps`, `host_gbps`, `host_gflops`: the cost model's
    rates (measured when not given: the host's once per machine, cached, again with `measure_host=True`; the link
    on CUDA).
    """
    from .loading.loader import load as _load

    return _load(model_dir, device=device, backend=backend, plan=plan, dtype=dtype, progress=progress,
                 cache_gb=cache_gb, cache_policy=cache_policy, experts=experts,
                 host_cache_gb=host_cache_gb, lookahead=lookahead, lookahead_from=lookahead_from,
                 disk_read=disk_read, expert_compute=expert_compute, link_gbps=link_gbps, host_gbps=host_gbps,
                 host_gflops=host_gflops, measure_host=measure_host, **budget)


def transform_weights(model, fn, *, names=None):
    """Apply fn(name, tensor) -> tensor to weights of a loaded model, keeping every tensor in its tier."""
    from .run.transforms import transform_weights as _transform

    return _transform(model, fn, names=names)


def update_weights(model, weights):
    """Write new values (e.g. an RL weight update) into a loaded model's weights in place, keeping tiers."""
    from .run.transforms import update_weights as _update

    return _update(model, weights)


def audit(model, plan: Plan):
    """Every tensor whose actual tier differs from the plan: [(name, planned, actual, bytes)]; empty when in place."""
    from .run.auditor import audit as _audit

    return _audit(model, plan)


def plan(source, *, offload_gb: float | None = None, device_memory_gb: float | None = None,
         reserve_gb: float | None = None, policy: str = "sparse-first",
         offload_params: str | Sequence[str] | None = None, dtype: str | None = None, batch: int = 1,
         stats=None, host_memory_gb: float | None = None, cpu_only: bool = False) -> Plan:
    """Plan where every weight of a model lives.

    `source`: a model folder (its safetensors headers give real dtypes and bytes), a
    config.json path, or an nn.Module (meta or real). No tensor data is read.
    `offload_params`: one selector (a string) or several.
    `stats` (with policy="frequency"): layer -> decode-token picks per expert, e.g.
    `moe_offload.traces.expert_counts(moe_offload.traces.read_trace(path))`.
    `host_memory_gb`: the host tier's GiB; what leaves the device beyond it is planned on `disk`.
    `cpu_only`: plan for a machine whose device is host memory: `device_memory_gb` alone then bounds
    the RAM the weights hold and the rest is on disk (the CLI sets it from the device it resolves); the plan then
    also says how much of the reserve the process itself takes (measured once per installation:
    storage/process_memory.py).
    """
    from .planning import planner
    from .model.inventory import inventory
    from .storage.process_memory import planned_runtime_bytes

    inv = inventory(source, dtype=dtype)
    return planner.plan(inv, offload_gb=offload_gb, device_memory_gb=device_memory_gb, reserve_gb=reserve_gb,
                        policy=policy, offload_params=offload_params, batch=batch, stats=stats,
                        host_memory_gb=host_memory_gb, cpu_only=cpu_only,
                        runtime_bytes=planned_runtime_bytes(cpu_only, device_memory_gb))

