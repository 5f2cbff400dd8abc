"""Replay with host compute: where each decode step's offloaded experts would be computed, and the time per token
the cost model (planning/cost_model.py) predicts for a stated machine. Nothing runs and nothing is measured here.

Per decode token (batch 1) and routed layer, the picked experts fall in three groups, as the runtime's read plan
sorts them (run/read_plan.py, run/host_compute.py):

    device side   resident experts, and device-cache hits (replay's walk of the same cache objects,
                  routing/replay.walk_caches): their stored bytes D are read on the device
    streamed      offloaded experts the host cannot compute: a device-cache miss the cache admits (it travels to fill
                  its pages), an expert with a slice on the device, every expert of a layer with a routed tensor
                  resident whole: their offloaded bytes S cross the link in every mode
    host side     the rest of the offloaded picks, P of them: their offloaded (host + disk) bytes B, their FLOPs
                  F = P x the layer's FLOPs per (token, expert) pair (2 x one expert's parameters)

The side of the host-side experts is `choose(mode, step_cost(tokens=1, pairs=P, weight_bytes=B, flops=F,
hidden_bytes=h))`, as the runtime asks it (h: hidden size x the embedding's bytes per element). The step's time is
that side's, overlapping the device's own work:

    host      max(max(B / host_bw, F / host_flops) + A / link_bw,  S / link_bw + F_S / device_flops + D / device_bw)
    device    max((B + S) / link_bw,  D / device_bw) + (F + F_S) / device_flops
    s/token = sum over routed layer steps + resident dense bytes / device_bw + offloaded dense bytes / link_bw

A = h x (1 + P): the hidden state in, P weighted outputs back. Without a link (a CPU-only machine) both are the
cost model's `max(max(bytes / host_bw, FLOPs / host_flops), D / device_bw)` over every offloaded pick, and the
offloaded dense bytes are read at host_bw. A rate not given (device_bw, device_flops) is not limiting.

Not modelled: attention and KV-cache reads and compute, the routers, the device's FLOPs on dense weights (decode
reads them: bytes / bandwidth), disk bandwidth (a disk-tier expert's bytes are taken as read at host speed), which
formats the CPU kernels compute (run/fused.supports: bf16, FP8 blocks and MXFP4 are), and any overlap between
layers. It is a prediction for the machine described, not a measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from ..errors import MoeOffloadError
from ..planning.accounting import TokenBytes
from ..planning.cost_model import ExpertCompute, Hardware, choose, step_cost
from ..planning.placement import Plan, Tier
from ..formats.traces import Trace
from .replay import replay_inputs, walk_caches

ROUTED, EMBEDDING, LANGUAGE = "routed_expert", "embedding", "language"

FORMULA = ("ms/token = sum over routed layer steps of the chosen side's time + resident dense bytes / device_bw + "
           "offloaded dense bytes / link_bw; host: max(max(B/host_bw, F/host_flops) + A/link_bw, S/link_bw + "
           "D/device_bw), device: max((B + S)/link_bw, D/device_bw) + F/device_flops (B, F: the host-side experts' "
           "offloaded bytes and 2 x parameters; A: hidden state x (1 + their picks); S: bytes streamed in any mode "
           "(cache admissions, experts partly on the device); D: resident and cached experts' stored bytes); "
           "attention, KV cache and disk bandwidth not modelled")


@dataclass(frozen=True, eq=False)
class ComputeShape:
    """What the time model needs of a plan beyond its token bytes, per routed layer in tb.layers order: each
    expert's stored bytes in all tiers, whether the host can compute it (every 3-D routed tensor of its layer holds
    it off the device), the FLOPs of one (token, expert) pair; a token's hidden state in bytes; the resident dense
    bytes a decode token reads on the device."""

    tb: TokenBytes
    expert_bytes: np.ndarray      # int64 [layers, E]
    host_ok: np.ndarray           # bool [layers, E]
    flops_per_pair: np.ndarray    # int64 [layers]
    hidden_bytes: int
    device_dense_bytes: int


def compute_shape(plan: Plan, *, hidden_size: int | None = None) -> ComputeShape:
    """The plan's ComputeShape. hidden_size: default the input embedding's width (else the LM head's); the
    activations' bytes per element are the embedding's (2 for bf16)."""
    tb = plan.token_bytes()
    row = {layer: i for i, layer in enumerate(tb.layers)}
    stored = np.zeros((len(tb.layers), tb.num_experts), dtype=np.int64)
    host_ok = np.ones((len(tb.layers), tb.num_experts), dtype=bool)
    params = np.zeros(len(tb.layers), dtype=np.int64)
    device_dense, table = 0, None
    for t in plan.tensors:
        if t.role == ROUTED and t.experts and t.layer in row:
            i = row[t.layer]
            stored[i, :t.experts] += t.bytes // t.experts
            params[i] += t.numel // t.experts
            if len(t.shape) == 3:   # an expert's weight matrix: the host computes the experts it holds off the device
                off = np.zeros(tb.num_experts, dtype=bool)
                if t.tier != Tier.DEVICE:
                    off[list(t.offloaded_ids or range(t.experts))] = True
                host_ok[i] &= off
        elif t.component == LANGUAGE and t.tier == Tier.DEVICE and t.role != ROUTED:
            device_dense += t.bytes // t.shape[0] if t.role == EMBEDDING and t.shape else t.bytes
        if t.role in (EMBEDDING, "lm_head") and len(t.shape) == 2 and t.component == LANGUAGE:
            table = t if table is None or t.role == EMBEDDING else table
    if table is None:
        raise MoeOffloadError(f"the {plan.model_type} plan has no input embedding or LM head to size a token's hidden "
                              "state from: give hidden_size")
    width = hidden_size if hidden_size is not None else table.shape[1]
    return ComputeShape(tb, stored, host_ok, 2 * params, int(width * max(1, table.bytes // table.numel)),
                        device_dense)


@dataclass(frozen=True)
class ComputeReplay:
    """Per decode token averages (bytes, milliseconds) and totals (counts) of a replay under an expert-compute mode."""

    expert_compute: str               # auto, host or device
    tokens: int
    steps: int                        # routed layer steps: tokens x routed layers
    steps_on_host: int                # of them, those whose host-side experts ran on the host
    expected_ms_per_token: float
    expert_ms_per_token: float        # the layer steps
    dense_ms_per_token: float         # dense weights: resident over the device's bandwidth, offloaded over the link
    link_weight_bytes_per_token: float       # weights over the link: streamed experts + offloaded dense
    link_activation_bytes_per_token: float   # hidden states and expert outputs over the link (host compute)
    host_read_bytes_per_token: float         # expert bytes host compute reads where they lie (host memory, disk)
    counted_host_link_bytes_per_token: float   # the runtime's counters under this mode: host memory over the link
    counted_disk_read_bytes_per_token: float   # ... and from disk (a host-computed expert's disk bytes too)
    experts_on_host: int              # (token, expert) pairs computed on the host
    experts_on_device: int            # pairs computed on the device: resident, cached, streamed
    hardware: dict
    formula: str = FORMULA

    def to_dict(self) -> dict:
        return asdict(self)


def _stand_in(hw: Hardware, mode: ExpertCompute) -> Hardware:
    """Streaming over a link never uses the host rates (forced device: the host side's time is asked, never used):
    without them any positive rate stands in, so that a device-only prediction needs the link alone."""
    if mode is ExpertCompute.DEVICE and hw.link_bytes_per_s is not None and (
            hw.host_bytes_per_s is None or hw.host_flops_per_s is None):
        return replace(hw, host_bytes_per_s=hw.host_bytes_per_s or 1.0, host_flops_per_s=hw.host_flops_per_s or 1.0)
    if hw.host_bytes_per_s is None or hw.host_flops_per_s is None:
        raise MoeOffloadError(f"expert compute {mode.value} without the host's rates (host bytes/s "
                              f"{hw.host_bytes_per_s}, FLOP/s {hw.host_flops_per_s}): the host side is timed by them; "
                              "give both (--host-gbps and --host-gflops)")
    return hw


# Per layer step: host-side picks, their bytes, disk bytes and host-cache-held disk bytes; the same of the streamed
# picks; the device side's stored bytes.
_FIELDS = ("pairs", "bytes", "disk", "moved", "s_pairs", "s_bytes", "s_disk", "s_moved", "device")


def _steps(shape: ComputeShape, ids: np.ndarray, cache, host_cache, prefills=None) -> dict[str, np.ndarray]:
    """Each [T, layers] figure of _FIELDS, from the accesses of replay's walk (every offloaded pick, in order)."""
    tb = shape.tb
    t, n_layers, _ = ids.shape
    off_all = tb.expert_host + tb.expert_disk
    resident = np.concatenate([shape.expert_bytes - off_all, np.zeros((n_layers, 1), np.int64)], axis=1)
    safe = np.where(ids >= 0, ids, tb.num_experts).astype(np.int64)
    out = {"device": resident[np.arange(n_layers)[None, :, None], safe].sum(axis=2)}
    walk = walk_caches(tb, ids, cache=cache, host_cache=host_cache, admissions=True, prefills=prefills)
    lay, ex = walk.lay, walk.experts
    flat = walk.tok * n_layers + lay
    off, disk = off_all[lay, ex], tb.expert_disk[lay, ex]
    moved = np.where(walk.in_host, disk, 0)
    host = ~walk.hit & ~walk.admitted & shape.host_ok[lay, ex]
    streamed = ~walk.hit & ~host

    def per_step(mask: np.ndarray, values: np.ndarray | None) -> np.ndarray:
        w = None if values is None else values[mask].astype(np.float64)
        return np.rint(np.bincount(flat[mask], weights=w, minlength=t * n_layers)).astype(np.int64).reshape(
            t, n_layers)

    for prefix, mask in (("", host), ("s_", streamed)):
        for name, values in (("pairs", None), ("bytes", off), ("disk", disk), ("moved", moved)):
            out[prefix + name] = per_step(mask, values)
    out["device"] += per_step(walk.hit, off)     # a cached expert's stored bytes, read on the device
    return out


def replay_compute(shape: ComputeShape, ids: np.ndarray, mode: ExpertCompute, hw: Hardware, *, cache=None,
                   host_cache=None, prefills=None) -> ComputeReplay:
    """The decode tokens of `ids` ([T, layers, width] expert ids in shape.tb.layers order, -1 = none) under `mode`
    on `hw`, with the caches of replay (fresh objects: a walk uses them up) and what prompts' prefills left in the
    host cache (`prefills`: replay.prefill_picks). A pure function of its inputs."""
    tb = shape.tb
    t, n_layers, _ = ids.shape
    if n_layers != len(tb.layers):
        raise ValueError(f"routing of {n_layers} layers for a placement of {len(tb.layers)} routed layers")
    mode = ExpertCompute(mode)
    used = _stand_in(hw, mode)
    step = _steps(shape, ids, cache, host_cache, prefills)
    link, device_bw, device_flops = hw.link_bytes_per_s, hw.device_bytes_per_s, hw.device_flops_per_s
    h = shape.hidden_bytes
    # One cost per distinct step: steps repeat, and the cost model is scalar.
    keys = np.stack([np.broadcast_to(np.arange(n_layers), (t, n_layers))]
                    + [step[k] for k in ("pairs", "bytes", "s_pairs", "s_bytes", "device")], axis=-1)
    distinct, inverse = np.unique(keys.reshape(-1, 6), axis=0, return_inverse=True)
    on_host_u = np.zeros(len(distinct), dtype=bool)
    seconds = np.zeros(len(distinct))
    act = np.zeros(len(distinct), dtype=np.int64)
    for u, (row, pairs, nbytes, s_pairs, s_bytes, dbytes) in enumerate(distinct.tolist()):
        fpp = int(shape.flops_per_pair[row])
        device_s = dbytes / device_bw if device_bw else 0.0
        asked = step_cost(used, tokens=1, pairs=pairs, weight_bytes=nbytes, flops=pairs * fpp, hidden_bytes=h)
        on_host_u[u] = pairs > 0 and choose(mode, asked) is ExpertCompute.HOST
        if on_host_u[u] and link is not None:
            beside = s_bytes / link + (s_pairs * fpp / device_flops if device_flops else 0.0) + device_s
            seconds[u] = step_cost(used, tokens=1, pairs=pairs, weight_bytes=nbytes, flops=pairs * fpp,
                                   hidden_bytes=h, device_s=beside).host_s
            act[u] = asked.activation_bytes
        else:   # all offloaded picks streamed (or, without a link, read in place: the same time either way)
            seconds[u] = step_cost(used, tokens=1, pairs=pairs + s_pairs, weight_bytes=nbytes + s_bytes,
                                   flops=(pairs + s_pairs) * fpp, hidden_bytes=h, device_s=device_s).stream_s
    inverse = inverse.reshape(t, n_layers)
    on_host = on_host_u[inverse]
    expert_s = float(seconds[inverse].sum())
    dense_off = tb.dense_host + tb.dense_disk
    dense_s = (shape.device_dense_bytes / device_bw if device_bw else 0.0) + dense_off / (link or used.host_bytes_per_s)

    def total(name: str, where: np.ndarray | None = None) -> int:
        return int(step[name].sum() if where is None else step[name][where].sum())

    streamed = total("s_bytes") + total("bytes", ~on_host)
    # The runtime's counters (accounting.TokenBytes.step_bytes with on_host): a streamed expert's host bytes and its
    # host-cached disk bytes cross the link from host memory; every disk byte the host cache did not hold is read
    # from disk, wherever the expert is computed.
    host_link = (t * tb.dense_host + streamed - total("s_disk") - total("disk", ~on_host) + total("s_moved")
                 + total("moved", ~on_host))
    disk_read = t * tb.dense_disk + total("disk") + total("s_disk") - total("moved") - total("s_moved")
    pairs_host = total("pairs", on_host)
    picks = int(np.count_nonzero(ids >= 0))
    return ComputeReplay(
        expert_compute=mode.value, tokens=t, steps=t * n_layers, steps_on_host=int(on_host.sum()),
        expected_ms_per_token=(expert_s / t + dense_s) * 1e3, expert_ms_per_token=expert_s / t * 1e3,
        dense_ms_per_token=dense_s * 1e3, link_weight_bytes_per_token=(streamed + t * dense_off) / t,
        link_activation_bytes_per_token=int(act[inverse].sum()) / t,
        host_read_bytes_per_token=total("bytes", on_host) / t,
        counted_host_link_bytes_per_token=host_link / t, counted_disk_read_bytes_per_token=disk_read / t,
        experts_on_host=pairs_host, experts_on_device=picks - pairs_host, hardware=asdict(hw))


def compute_replay(plan: Plan, trace: Trace, mode: ExpertCompute | str, hw: Hardware, *,
                   cache_gb: float | None = None, cache_policy: str | None = None,
                   host_cache_gb: float | None = None, hidden_size: int | None = None) -> ComputeReplay:
    """`replay`'s trace, plan and caches (replay.replay_inputs, fresh caches), under an expert-compute mode on a
    stated machine: see replay_compute."""
    inputs = replay_inputs(plan, trace, cache_gb=cache_gb, cache_policy=cache_policy, host_cache_gb=host_cache_gb)
    return replay_compute(compute_shape(plan, hidden_size=hidden_size), inputs.ids, ExpertCompute(mode), hw,
                          cache=inputs.cache, host_cache=inputs.host_cache, prefills=inputs.prefills)
