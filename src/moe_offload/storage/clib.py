"""The process's C library, where it has one: the few allocator and memory-advice calls torch does not make for us
(glibc's malloc_trim and mallopt, Linux's madvise), found once per process and shared by their callers."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def libc_function(name: str):
    """The C library's function `name` (a ctypes function), or None where there is no such library or function."""
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None
