"""Weights in 2 MiB pages: Linux transparent huge pages asked for the memory the kernels stream.

A decode step reads every resident weight it uses once, front to back (the CPU kernels, kernels/csrc): a released
layer's expert row or lm_head row is one 4 KiB page of bf16, so in ordinary pages each row costs a TLB miss and
the hardware prefetcher starts afresh at it. In 2 MiB pages the same read runs faster (Qwen3-30B-A3B's lm_head,
bf16, 1.2 GB, on a 2-core Xeon SPR: 11.5 -> 15.2 GB/s at one thread, 22.4 -> 30.5 GB/s at two). llama.cpp's
memory-mapped GGUF gets large pages from the page cache where the file system gives it large folios; anonymous
memory gets them only when asked, and most distributions ship `madvise` mode
(/sys/kernel/mm/transparent_hugepage/enabled), where nothing is huge unless the process says so.

`advise_huge(t)` says so for the whole 2 MiB pages inside a cpu tensor's bytes, before they are first written
(the page faults then allocate huge pages; memory already touched is left to the kernel's khugepaged). It changes
no byte and no size: the advised range lies inside the tensor, so the resident set is the tensor's, as planned.
Where the kernel has no transparent huge pages, or says `never`, it is a no-op (0 bytes advised).
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import torch

from .clib import libc_function

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14                     # <sys/mman.h>, Linux
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _madvise():
    f = libc_function("madvise") if platform.system() == "Linux" else None
    if f is not None:
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
    return f


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting: 'always', 'madvise' or 'never'; None where there is none."""
    try:
        text = SETTING.read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def huge_span(address: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole 2 MiB pages inside [address, address + nbytes); length 0 when there are none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(end - start, 0)


def advise_huge(t: torch.Tensor) -> int:
    """Ask for huge pages under `t`'s storage (a cpu tensor, before its first write); the bytes advised."""
    if t.device.type != "cpu" or thp_mode() in (None, "never"):
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    storage = t.untyped_storage()
    start, length = huge_span(storage.data_ptr(), storage.nbytes())
    if length == 0 or madvise(start, length, MADV_HUGEPAGE) != 0:
        return 0
    return length
