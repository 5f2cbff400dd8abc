"""The selected experts' matrix-vector products, read from the stored format: the Python face of csrc/expert_gemv.cpp.

    out = expert_gemv(x, stack, ids)                       # out[s, o] = sum_i stack[ids[s]][o, i] * x[s, i]

    out = expert_gemv(x, (stack_a, stack_b), rows, which=which)   # pair s: expert rows[s] of stack which[s]

`stack` is an expert stack as it lies: float32 / bfloat16 / float16 [E, O, K] (or [E, K, O] with
`transposed=True`), an `Fp8Stack` (e4m3 values [E, O, K] and float32 block scales) or an `Mxfp4Stack` (e2m1
blocks [E, O, K/32, 16] and e8m0 scales [E, O, K/32]). The result is float32 [S, O]; the caller rounds it to
its dtype. Only the experts named in `ids` are read, each once for all the pairs that picked it. Float stacks of
one dtype and matrix shape may be read in one call (a tuple of them, `which` naming each pair's): the experts of
a layer lying in several places (the module's parameter, a cache's arena) cost one call, not one per place.

The arithmetic is defined in the source's header and computed identically by its AVX-512, AVX2 and portable
paths: `Isa` picks one (default: the best this CPU runs, capped by torch's own `ATEN_CPU_CAPABILITY`, so the
suite's second kernel path runs the portable code).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch

from .build import kernels


class Isa(enum.IntEnum):
    PORTABLE = 0
    AVX2 = 1
    AVX512 = 2


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # the float stacks the kernel reads as they lie

MAX_PREFETCH = 65536   # bytes; the source's MAX_PREFETCH

_ATEN_CAP = {"default": Isa.PORTABLE, "avx2": Isa.AVX2, "avx512": Isa.AVX512}


def best_isa() -> Isa:
    """The fastest path this CPU runs, no higher than torch's ATEN_CPU_CAPABILITY when that is set."""
    kernels()
    best = Isa(int(torch.ops.moe_offload.best_isa()))
    cap = _ATEN_CAP.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    return min(best, cap) if cap is not None else best


@dataclass(frozen=True)
class Fp8Stack:
    """e4m3 values [E, O, K] (float8_e4m3fn or their uint8 bytes), float32 scales [E, R, ceil(K / block_k)],
    `row_block` int32 [O]: the scale row of each output row (fp8_row_blocks)."""
    values: torch.Tensor
    scales: torch.Tensor
    row_block: torch.Tensor
    block_k: int


@dataclass(frozen=True)
class Mxfp4Stack:
    """e2m1 blocks uint8 [E, O, G, 16] (low nibble first) and e8m0 scales uint8 [E, O, G]."""
    blocks: torch.Tensor
    scales: torch.Tensor


def fp8_row_blocks(rows: int, block_rows: int, parts: int = 1) -> torch.Tensor:
    """int32 [rows]: the scale row of each output row of an FP8 tensor made of `parts` matrices stacked by rows
    (gate_up_proj: 2), each with its own grid of `block_rows`-row blocks (quant_codecs.fp8_scale_shape)."""
    part_rows = rows // parts
    per_part = -(-part_rows // block_rows)
    o = torch.arange(rows)
    return ((o // part_rows) * per_part + (o % part_rows) // block_rows).to(torch.int32)


ROWS_IN_FLIGHT = (1, 2, 4, 8)   # the source's by_rows


@dataclass(frozen=True)
class Prefetch:
    """How the kernel reads a stack's rows from memory: how far ahead of the read position it asks for a row's
    lines, in bytes (0: no request), `l1` into L1, `l2` into L2; and `rows`, how many rows of one expert it reads
    together (the float formats; several streams of misses in flight where one leaves the core waiting). No
    arithmetic changes with any of them; prefetch_distances() is what a call uses by default."""
    l1: int
    l2: int
    rows: int = 1

    def __post_init__(self):
        for level, ahead in (("l1", self.l1), ("l2", self.l2)):
            if not (isinstance(ahead, int) and 0 <= ahead <= MAX_PREFETCH):
                raise ValueError(f"Prefetch.{level} is {ahead!r}: a distance is 0 (none) to {MAX_PREFETCH} bytes ahead")
        if not (isinstance(self.rows, int) and self.rows in ROWS_IN_FLIGHT):
            raise ValueError(f"Prefetch.rows is {self.rows!r}: the kernel reads {', '.join(map(str, ROWS_IN_FLIGHT))} "
                             "rows together")


def prefetch_distances() -> Prefetch:
    """This CPU's default read shape (AMD 512 / 2048 bytes ahead, one row; others 256 / none, eight rows together;
    the source's header says why)."""
    kernels()
    l1, l2, rows = torch.ops.moe_offload.prefetch_distances()
    return Prefetch(int(l1), int(l2), int(rows))


def expert_gemv(x: torch.Tensor, stack, ids: torch.Tensor, *, transposed: bool = False,
                isa: Isa | None = None, prefetch: Prefetch | None = None,
                which: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [S, O]: x [S, K] (any float dtype) through expert ids[s] of `stack` for each s (`stack` a tuple of
    float stacks: of stack[which[s]]). Inside a compiled step give `isa` (best_isa() once, outside): the query is
    opaque to torch.compile. `prefetch` overrides this CPU's distances (benchmarks compare them in one process)."""
    if isa is None:
        isa = best_isa()
    elif not torch.compiler.is_compiling():
        kernels()
    x = x.float()
    ids = ids.reshape(-1).long()
    op = torch.ops.moe_offload.expert_gemv
    pf = (-1, -1, -1) if prefetch is None else (prefetch.l1, prefetch.l2, prefetch.rows)
    if which is not None and not isinstance(stack, (tuple, list)):
        raise ValueError("expert_gemv: `which` names each pair's stack of a tuple of stacks; one stack was given")
    if isinstance(stack, Fp8Stack):
        values = stack.values.view(torch.uint8) if stack.values.dtype != torch.uint8 else stack.values
        return op(x, values, ids, 1, stack.scales.float(), stack.row_block, stack.block_k, False, int(isa), *pf)
    if isinstance(stack, Mxfp4Stack):
        return op(x, stack.blocks, ids, 2, stack.scales, None, 0, False, int(isa), *pf)
    if isinstance(stack, (tuple, list)):
        if which is None or not stack:
            raise ValueError("expert_gemv over several stacks needs `which`, the stack of each pair")
        return op(x, stack[0], ids, 0, None, None, 0, transposed, int(isa), *pf, list(stack[1:]),
                  which.reshape(-1).long())
    return op(x, stack, ids, 0, None, None, 0, transposed, int(isa), *pf)
