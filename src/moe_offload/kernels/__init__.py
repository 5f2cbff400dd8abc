"""CPU kernels that compute experts from their stored bytes (bf16, FP8 blocks, MXFP4 blocks), built once per machine."""

from .build import KernelUnavailable, kernels
from .gemv import (FLOAT_DTYPES, Fp8Stack, Isa, Mxfp4Stack, Prefetch, best_isa, expert_gemv, fp8_row_blocks,
                   prefetch_distances)

__all__ = ["KernelUnavailable", "kernels", "FLOAT_DTYPES", "Fp8Stack", "Mxfp4Stack", "Isa", "best_isa", "expert_gemv",
           "fp8_row_blocks", "Prefetch", "prefetch_distances"]
