"""The process's C library, where it has one: the few allocator and memory-advice calls torch does not make for us
(glibc's malloc_trim and mallopt, Linux's madvise), found once per process and shared by their callers, and the
memmove the disk tier's reader threads copy with (copy_bytes)."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import torch


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


def copy_bytes(dst, src) -> None:
    """dst <- src, two contiguous cpu tensors of the same byte size, by the C library's memmove on the calling
    thread alone (the GIL released meanwhile, as ctypes releases it around a foreign call).

    For the disk tier's reader threads (storage/disk.py, run/host_cache.py): torch's copy_ of a large tensor
    splits it over OpenMP, and called from a thread outside torch's own pool it starts an OpenMP team of its own,
    whose threads then spin, waiting for more work, on the cores the decode step's team computes on. And for the
    mapped reader (storage/mapped.py), whose copies fault pages in from disk: a memoryview slice assignment would
    hold the GIL all the while. Where there is no C library (not Linux / glibc-like), torch's copy_."""
    n = dst.numel() * dst.element_size()
    if n != src.numel() * src.element_size() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"copy_bytes: {n} contiguous bytes into, {src.numel() * src.element_size()} from "
                         f"(contiguous: {dst.is_contiguous()}, {src.is_contiguous()})")
    if dst.device.type != "cpu" or src.device.type != "cpu":
        raise ValueError(f"copy_bytes: cpu tensors only, not {dst.device} <- {src.device}")
    memmove = _memmove()
    if memmove is None:
        dst.view(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
    elif n:
        memmove(dst.data_ptr(), src.data_ptr(), n)


@lru_cache(maxsize=1)
def _memmove():
    f = libc_function("memmove")
    if f is not None:
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        f.restype = ctypes.c_void_p
    return f
