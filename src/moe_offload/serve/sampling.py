"""Per-request sampling inside transformers' continuous batching, on the logits' device, in one pass.

The batch is decoded greedily (argmax, `do_sample=False`: a greedy request's tokens are the argmax of its
logits, as `generate` picks them). For the rows of requests that asked for sampling (temperature > 0), this
logits processor draws each row's token from its own distribution (temperature and top-p applied) and leaves
that row's logits one-hot on the draw, so the argmax takes it.

The draw is the Gumbel-max form of sampling, vectorized over the sampled rows: token = argmax(logits / T +
G) over the top-p set, where G = -log(-log(U)) and U is uniform noise from a counter-based hash of (the
request's seed, its draw number, the token id), computed with int64 tensor arithmetic that never overflows
(products stay below 2^63), on the logits' device. So no per-row Python loop, no device-to-host read and no
generator of another device (the row indices, temperatures, top-p values, seeds and draw numbers are host-side
lists, copied to the device), and a seeded request draws the same tokens whatever else is in the batch and on
any device (integer arithmetic is exact everywhere; the floating-point part is the same few ops). A request
without a seed gets one from the OS.

It is a `ContinuousBatchingLogitsProcessor` (transformers' interface for per-request processors): each step,
`prepare_tensor_args` gives every row of the batch the slot of its request's draw (-1: greedy) and keeps the
same on the host, and `__call__` rewrites the sampled rows. `install` adds it to a manager before the manager
starts.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import torch

from ..run.transformers_compat import ContinuousBatchingLogitsProcessor, add_logits_processor

MASK32 = 0xFFFFFFFF


@dataclass
class Draw:
    temperature: float
    top_p: float
    seed: int          # 64 bits
    step: int = 0      # draws made so far


class Sampler(ContinuousBatchingLogitsProcessor):
    supported_kwargs: dict = {}
    ignored_kwargs: tuple = ()

    def __init__(self):
        self._draws: dict[str, Draw] = {}
        self._rows: list[tuple[int, Draw]] = []   # this step's sampled rows: (row, its draw)
        self._lock = threading.Lock()
        self.usable = False          # set by install(): the manager took it

    def add(self, request_id: str, temperature: float, top_p: float, seed: int | None) -> None:
        seed = secrets.randbits(64) if seed is None else seed % 2**64
        with self._lock:
            self._draws[request_id] = Draw(temperature, top_p, seed)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._draws.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._draws)

    # --- the ContinuousBatchingLogitsProcessor interface (called on the batch's thread) ---

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        rows, out = [], []
        with self._lock:
            for i, request in enumerate(requests_with_new_token):
                draw = self._draws.get(request.state.request_id)
                out.append(-1 if draw is None else len(rows))
                if draw is not None:
                    rows.append((i, draw))
        self._rows = rows
        return torch.tensor(out, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = [(i, d) for i, d in self._rows if i < scores.size(0)]
        if not rows:
            return scores
        draws = [d for _, d in rows]
        idx = torch.tensor([i for i, _ in rows], device=scores.device)
        tokens = draw_tokens(scores.index_select(0, idx), [d.temperature for d in draws],
                             [d.top_p for d in draws], [d.seed for d in draws], [d.step for d in draws])
        for d in draws:
            d.step += 1
        onehot = torch.full((len(rows), scores.size(1)), float("-inf"), dtype=scores.dtype, device=scores.device)
        onehot.scatter_(1, tokens.unsqueeze(1), 0.0)
        return scores.index_copy(0, idx, onehot)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), in int64 without overflow: c split into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & MASK32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds, the lowbias32 constants) of h in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def uniforms(seeds: list[int], steps: list[int], vocab: int, device) -> torch.Tensor:
    """[R, vocab] float32 in (0, 1): row r from (seeds[r], steps[r], token id), the same bits on every device."""
    s = torch.tensor([[x & MASK32, (x >> 32) & MASK32, t & MASK32] for x, t in zip(seeds, steps)],
                     dtype=torch.int64, device=device)
    key = _mix32(s[:, 0:1] ^ _mix32(s[:, 1:2] ^ _mix32(s[:, 2:3])))           # [R, 1]
    cols = torch.arange(vocab, dtype=torch.int64, device=device).unsqueeze(0)
    h = _mix32(cols ^ key)                                                       # [R, vocab]
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)


def draw_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], seeds: list[int],
                steps: list[int]) -> torch.Tensor:
    """[R] token ids, one per row of logits [R, V]: from softmax(logits / temperature), restricted to the
    smallest top-p set (at least one token), by Gumbel-max with the rows' own noise. On logits' device."""
    dev = logits.device
    z = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=dev).unsqueeze(1)
    gumbel = -torch.log(-torch.log(uniforms(seeds, steps, logits.size(1), dev)))
    if all(p >= 1.0 for p in top_p):   # no top-p set to find (a host-side check: no sort, no read back)
        return (z + gumbel).argmax(dim=-1)
    sorted_p, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < torch.tensor(top_p, dtype=torch.float32, device=dev).unsqueeze(1)
    keep[:, 0] = True
    keep = torch.zeros_like(keep).scatter_(1, order, keep)
    return torch.where(keep, z + gumbel, float("-inf")).argmax(dim=-1)


def install(manager, sampler: Sampler) -> bool:
    """Add the sampler to a continuous batching manager that has not started; False where this transformers'
    manager has no place for it (sampled requests are then refused with a clear error)."""
    sampler.usable = add_logits_processor(manager, sampler)
    return sampler.usable
