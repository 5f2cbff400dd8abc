"""Disk-tier reads through a memory map of the checkpoint: the page cache decides what stays (llama.cpp's way).

`MappedReader` is a `SafetensorsReader` (disk.py) whose reads copy the asked byte ranges out of a read-only
`mmap` of the whole file, with the kernel's default readahead, and never release the pages: whatever the
kernel keeps cached (its LRU over pages, under the memory the process and its cgroup may use) is read again
from RAM, the rest from disk. Same bytes, same counters, same destinations as the O_DIRECT and buffered
readers: only the I/O differs, so `load(disk_read="mmap")` measures the page cache against our own caches
(host_cache.py) in the same runtime.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from .clib import copy_bytes
from .disk import SafetensorsReader

MODES = ("direct", "mmap")   # load(disk_read=...): O_DIRECT where the filesystem allows it, or the page cache


class MappedReader(SafetensorsReader):
    """Reads a safetensors file through a memory map of it (page cache kept)."""

    def __init__(self, path, **_):
        super().__init__(path, direct=False)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_NORMAL)    # default readahead, as a plain mmap gets
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        # The map's bytes as a tensor, only ever read: copies out of it are memmoves (clib.copy_bytes) that release
        # the GIL while they fault pages in from disk (a memoryview slice assignment holds it all the while, stalling
        # the decode step's Python meanwhile).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def mechanism(self) -> str:
        return "mmap (the page cache decides what stays, as llama.cpp's memory-mapped weights)"

    def _read_buffered(self, offset: int, dests: list[memoryview]) -> None:
        pos = offset
        total = sum(len(d) for d in dests)
        # Against the file's size now, not the map's: pages of a map past a file cut short fault (SIGBUS).
        size = os.fstat(self._fd).st_size
        if offset + total > min(size, len(self._map)):
            raise self._short(offset, total, max(0, min(size, len(self._map)) - offset))
        for d in dests:
            if len(d):
                copy_bytes(torch.frombuffer(d, dtype=torch.uint8), self._bytes[pos:pos + len(d)])
            pos += len(d)
        self._count(total)

    def close(self) -> None:
        self._bytes = None                  # before the map it points into is closed
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        super().close()
