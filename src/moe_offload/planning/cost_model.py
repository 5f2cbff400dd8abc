"""Where a layer step's offloaded experts are computed: on the host, where their bytes lie, or on the device, after
their bytes travel over the link. A pure function of the step and the hardware; the runtime asks it per step, `plan`
prints its crossover, `replay` turns a trace into an expected time per token with it.

The experts in question are those a step would read from below the device (host tier, host cache, disk-tier rows
once read into host memory); resident and device-cached experts are computed on the device either way, at the same
time as the host computes (overlap), so they do not enter the choice except through `device_s`.

    host compute   max(B / host_bw, F / host_flops) + A / link_bw
    streaming      B / link_bw + F / device_flops

B: the distinct host-side experts' stored bytes; F: 2 x multiply-adds of their (token, expert) pairs; A: the
activations that cross the link for host compute (each token's hidden state in, each host pair's weighted output
back: the device sums every pair's output in the model's own order, so the tokens do not depend on where an expert
ran). Each side overlaps the device's own work of the step (`device_s`: its resident and cached experts): a step
takes max(side, device_s); the faster side is chosen, the device on a tie (no worker, nothing to send).

Without a link (a CPU-only machine: the device's memory is the host's, and "streaming" reads the same bytes in
place) host compute can only add the worker's hand-off: `device` is chosen unless forced. With a link, decode steps
(a few tokens, each expert's bytes read for one or two pairs) go to the host, long prefills (each expert serving many
tokens: F grows with the tokens, B stops growing at all the experts) to the device: `crossover_tokens` finds where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class ExpertCompute(str, Enum):
    """--expert-compute: where offloaded experts are computed."""

    AUTO = "auto"       # per layer step, by the cost model
    HOST = "host"       # always on the host (the CPU kernels on their stored bytes)
    DEVICE = "device"   # always on the device: their bytes travel (the behaviour before host compute)


@dataclass(frozen=True)
class Hardware:
    """What the cost model knows of a machine, in bytes and FLOPs per second (None: not limiting / not there)."""

    host_bytes_per_s: float           # the host's read bandwidth, as the experts kernels read (measured)
    host_flops_per_s: float           # the host's FLOP rate of the experts kernels at many rows (measured)
    link_bytes_per_s: float | None    # host -> device; None: no link (CPU only: the device memory is the host's)
    device_flops_per_s: float | None = None   # the device's FLOP rate on streamed experts; None: not limiting
    device_bytes_per_s: float | None = None   # the device memory's read bandwidth (replay's device-side time)

    def __post_init__(self):
        for name in ("host_bytes_per_s", "host_flops_per_s", "link_bytes_per_s", "device_flops_per_s",
                     "device_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v}: a rate is a positive number")


@dataclass(frozen=True)
class StepCost:
    """The model's figures for one layer step's host-side experts, and its choice."""

    choice: ExpertCompute       # HOST or DEVICE
    host_s: float               # computed on the host (activations over the link included)
    stream_s: float             # streamed to the device and computed there
    weight_bytes: int           # B: what streaming moves over the link (what host compute reads in host memory)
    activation_bytes: int       # A: what host compute moves over the link


def step_cost(hw: Hardware, *, tokens: int, pairs: int, weight_bytes: int, flops: int, hidden_bytes: int,
              out_bytes: int | None = None, device_s: float = 0.0) -> StepCost:
    """The cost of one layer step's host-side experts: `tokens` rows in the step, `pairs` (token, expert) pairs routed
    to host-side experts, `weight_bytes` their distinct experts' stored bytes, `flops` their pairs' FLOPs,
    `hidden_bytes` one token's hidden state (H x dtype bytes; `out_bytes` one pair's output, default the same),
    `device_s` the device's own work of the step, which either side overlaps."""
    if pairs <= 0 or weight_bytes <= 0:
        return StepCost(ExpertCompute.DEVICE, device_s, device_s, 0, 0)
    out = hidden_bytes if out_bytes is None else out_bytes
    activations = tokens * hidden_bytes + pairs * out
    host = max(weight_bytes / hw.host_bytes_per_s, flops / hw.host_flops_per_s)
    if hw.link_bytes_per_s is None:       # no link: the device reads the same memory in place
        host_s, stream_s = max(host, device_s), max(host, device_s)
        return StepCost(ExpertCompute.DEVICE, host_s, stream_s, weight_bytes, 0)
    host_s = max(host + activations / hw.link_bytes_per_s, device_s)
    device_compute = flops / hw.device_flops_per_s if hw.device_flops_per_s else 0.0
    stream_s = max(weight_bytes / hw.link_bytes_per_s, device_s) + device_compute
    choice = ExpertCompute.HOST if host_s < stream_s else ExpertCompute.DEVICE
    return StepCost(choice, host_s, stream_s, weight_bytes, activations)


def choose(mode: ExpertCompute, cost: StepCost | None) -> ExpertCompute:
    """The side a step runs on: a forced mode, else the cost model's choice."""
    if mode is not ExpertCompute.AUTO:
        return mode
    return cost.choice if cost is not None else ExpertCompute.DEVICE


@dataclass(frozen=True)
class LayerShape:
    """One routed layer as the crossover sees it (uniform routing): experts, top-k, and per expert its stored bytes
    off the device (0 where resident), its FLOPs per pair, a token's hidden bytes."""

    experts: int
    top_k: int
    host_expert_bytes: float    # mean stored bytes of an expert that lies off the device
    host_fraction: float        # the share of the layer's experts that lie off the device
    flops_per_pair: int
    hidden_bytes: int


def expected_step(hw: Hardware, shape: LayerShape, tokens: int) -> StepCost:
    """The cost of a step of `tokens` rows under uniform routing: E (1 - (1 - k/E)^T) distinct experts expected,
    the off-device share of them and of the pairs host-side."""
    e, k = shape.experts, shape.top_k
    distinct = e * (1.0 - (1.0 - k / e) ** tokens)
    pairs = tokens * k * shape.host_fraction
    return step_cost(hw, tokens=tokens, pairs=max(1, round(pairs)) if pairs else 0,
                     weight_bytes=int(distinct * shape.host_fraction * shape.host_expert_bytes),
                     flops=int(pairs * shape.flops_per_pair), hidden_bytes=shape.hidden_bytes)


def crossover_tokens(hw: Hardware, shape: LayerShape, max_tokens: int = 1 << 16) -> int | None:
    """The fewest tokens per step from which the host-side experts are predicted faster on the device (they then
    travel); None when host compute stays ahead up to `max_tokens` or never is (no link)."""
    if hw.link_bytes_per_s is None or expected_step(hw, shape, 1).choice is not ExpertCompute.HOST:
        return None if hw.link_bytes_per_s is None else 1
    lo, hi = 1, 2
    while expected_step(hw, shape, hi).choice is ExpertCompute.HOST:
        if hi >= max_tokens:
            return None
        lo, hi = hi, min(2 * hi, max_tokens)
    while hi - lo > 1:            # host at lo, device at hi: the boundary in between
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if expected_step(hw, shape, mid).choice is ExpertCompute.HOST else (lo, mid)
    return hi


def layer_shape(plan) -> LayerShape | None:
    """The mean routed layer of a plan as the crossover sees it (None: no routed expert lies off the device):
    experts, top-k, the mean stored bytes of an off-device expert and the off-device share (accounting.TokenBytes),
    FLOPs per pair from the experts' weight matrices (their in-memory shapes: what they compute as, whatever they
    are stored as), a token's hidden state from the embedding's width (activations in bf16)."""
    import numpy as np

    from ..model.roles import Role

    tb = plan.token_bytes()
    per_expert = tb.expert_host + tb.expert_disk          # [routed layers, E] off-device bytes
    off = per_expert > 0
    if not per_expert.size or not off.any():
        return None
    routed = [t for t in plan.tensors if t.role == Role.ROUTED_EXPERT and t.experts and len(t.shape) == 3]
    layers = {t.layer for t in routed}
    params = sum(math.prod(t.shape[1:]) for t in routed) / max(1, len(layers))
    width = max((t.shape[-1] for t in plan.tensors if t.role == Role.EMBEDDING and len(t.shape) == 2), default=0)
    return LayerShape(experts=int(tb.num_experts), top_k=int(max(t.top_k or 1 for t in routed)),
                      host_expert_bytes=float(per_expert[off].mean()), host_fraction=float(np.mean(off)),
                      flops_per_pair=int(2 * params), hidden_bytes=int(width) * 2)
