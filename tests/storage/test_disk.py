"""moe_offload.storage.disk: tensors read from the checkpoint's own safetensors files, at their header offsets.

Files come from make_tiny (per-expert Qwen3-MoE, fused gpt-oss) or safetensors' own save_file; every
comparison is against safetensors' own load of the same file. Byte ranges expected in a file are computed
here from the raw header (8-byte length + JSON), independently of the reader.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_offload.storage.disk import DIRECT_ALIGN, BouncePool, SafetensorsReader, checkpoint_readers
from moe_offload.storage.disk_prefetch import DensePrefetcher
from moe_offload.errors import CheckpointError
from moe_offload.tiny.make import make_tiny

MODES = ("direct", "fadvise")
SMALL = dict(layers=2, experts=6, top_k=2, hidden=32)


def _direct_ok(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"x" * DIRECT_ALIGN)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _reader(path: Path, mode: str, **kw) -> SafetensorsReader:
    """The reader in `mode`; where the filesystem refuses O_DIRECT, direct mode must say so (and auto must
    fall back, visibly) rather than run: that is asserted, and the fadvise reader returned."""
    if mode == "direct" and not _direct_ok(path.parent):
        with pytest.raises(CheckpointError, match="O_DIRECT"):
            SafetensorsReader(path, direct=True, **kw)
        auto = SafetensorsReader(path, **kw)
        assert auto.mechanism.startswith("posix_fadvise")
        return auto
    return SafetensorsReader(path, direct=mode == "direct", **kw)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _spans(path: Path) -> dict[str, tuple[int, int]]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__"}


def _runs(ranges) -> list[tuple[int, int]]:
    """(offset, length) of the maximal runs of touching [start, end) ranges."""
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += end - start
        else:
            out.append([start, end - start])
    return [tuple(r) for r in out]


def _aligned(runs, size: int) -> int:
    """Bytes O_DIRECT reads for `runs`: each run's 4096-aligned superset, cut at the end of the file."""
    return sum(min(-(-(o + n) // DIRECT_ALIGN) * DIRECT_ALIGN, size) - o // DIRECT_ALIGN * DIRECT_ALIGN
               for o, n in runs)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:   # per-expert layout on disk: experts.{e}.{gate,up,down}_proj.weight
    return make_tiny(tmp_path_factory.mktemp("disk") / "qwen", family="qwen3_moe", **SMALL)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:  # fused [E, ...] experts on disk, stored [E, in, out]
    return make_tiny(tmp_path_factory.mktemp("disk") / "gpt", family="gpt_oss", **SMALL)


@pytest.fixture
def mixed(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 33, generator=g),
        "bf16": torch.randn(5, 3, 17, generator=g).to(torch.bfloat16),
        "f16": torch.randn(1001, generator=g).to(torch.float16),
        "i64": torch.arange(-40, 41),
        "u8": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
        "f8": torch.randn(9, 64, generator=g).to(torch.float8_e4m3fn),
        "flag": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "experts": torch.randn(6, 3, 5, 7, generator=g),   # [E, 3, 5, 7] and, read at dim 1, [3, E', 5, 7]
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


# --- whole tensors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_whole_tensors_are_byte_exact_in_every_dtype(mixed, mode):
    path, _ = mixed
    ref = load_file(str(path))
    with _reader(path, mode, bounce_bytes=2 * DIRECT_ALIGN) as r:   # small bounce: reads span windows
        for name, want in ref.items():
            got = r.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(_raw(got), _raw(want))               # bytes: NaN and -0.0 included
            out = torch.zeros_like(want)
            assert r.read(name, out=out) is out and torch.equal(_raw(out), _raw(want))


@pytest.mark.parametrize("mode", MODES)
def test_only_the_asked_bytes_are_read_one_call_per_tensor(mixed, mode):
    path, _ = mixed
    spans = _spans(path)
    with _reader(path, mode) as r:
        r.read("u8")
        start, end = spans["u8"]
        if r.direct:   # the aligned superset, in one call (the bounce buffer is larger)
            assert (r.read_calls, r.bytes_read) == (1, _aligned([(start, end - start)], path.stat().st_size))
        else:
            assert (r.read_calls, r.bytes_read) == (1, end - start)


def test_output_buffer_is_checked(mixed):
    path, tensors = mixed
    with SafetensorsReader(path, direct=False) as r:
        for bad in (torch.empty(7, 33, dtype=torch.float64), torch.empty(7, 32), torch.empty(33, 7).t()):
            with pytest.raises(ValueError, match="f32"):
                r.read("f32", out=bad)
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            r.read("nope")
        assert r.read_calls == 0


# --- experts ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_per_expert_layout_reads_only_the_selected_experts(qwen, mode):
    path = qwen / "model.safetensors"
    spans = _spans(path)
    picked = (1, 2, 5)                # 1 and 2 lie side by side in the file: one read for both
    names = [f"model.layers.1.mlp.experts.{e}.{m}.weight" for e in picked for m in ("gate_proj", "up_proj",
                                                                                     "down_proj")]
    runs = _runs(spans[n] for n in names)
    assert len(runs) == 2
    with _reader(path, mode) as r, safe_open(str(path), "pt") as f:
        got = r.read_tensors(names)
        assert all(torch.equal(g, f.get_tensor(n)) for g, n in zip(got, names))
        if r.direct:
            assert r.read_calls == 2 and r.bytes_read == _aligned(runs, path.stat().st_size)
        else:
            assert (r.read_calls, r.bytes_read) == (2, sum(n for _, n in runs))
            assert r.bytes_read == sum(spans[n][1] - spans[n][0] for n in names)   # nothing else


@pytest.mark.parametrize("mode", MODES)
def test_fused_layout_reads_runs_of_consecutive_experts(gpt_oss, mode):
    path = gpt_oss / "model.safetensors"
    name = "model.layers.0.mlp.experts.gate_up_proj"
    start, end = _spans(path)[name]
    with _reader(path, mode) as r, safe_open(str(path), "pt") as f:
        full = f.get_tensor(name)                      # [E, H, 2I]: gpt-oss stores [E, in, out]
        row = (end - start) // full.shape[0]
        picked = [4, 0, 3]                             # any order; runs {0} and {3, 4}
        assert r.expert_ranges(name, picked) == [(start, row), (start + 3 * row, 2 * row)]
        got = r.read_experts(name, picked)
        assert torch.equal(got, full[picked])          # each expert's block as stored, in the order asked
        if r.direct:
            runs = [(start, row), (start + 3 * row, 2 * row)]
            assert r.read_calls == 2 and r.bytes_read == _aligned(runs, path.stat().st_size)
        else:
            assert (r.read_calls, r.bytes_read) == (2, 3 * row)
        out = torch.empty(3, *full.shape[1:], dtype=full.dtype)
        calls = r.read_calls
        assert r.read_experts(name, [1, 2, 3], out=out) is out and torch.equal(out, full[1:4])
        assert r.read_calls == calls + 1                # adjacent experts coalesce into one read


@pytest.mark.parametrize("mode", MODES)
def test_an_inner_expert_dimension_is_strided_and_says_so(mixed, mode):
    path, tensors = mixed
    full = tensors["experts"]                         # read as [3, E, 5, 7]: dim 1 indexes experts
    packed = full.permute(1, 0, 2, 3).contiguous()
    strided = path.with_name("strided.safetensors")
    save_file({"w": packed}, str(strided))
    start, _ = _spans(strided)["w"]
    inner = 5 * 7 * 4
    with _reader(strided, mode) as r:
        # one range per leading index and run of consecutive experts: {1, 2} and {4}
        assert r.expert_ranges("w", [4, 1, 2], dim=1) == [
            (start + (o * 6 + e) * inner, n * inner) for o in range(3) for e, n in ((1, 2), (4, 1))]
        got = r.read_experts("w", [4, 1, 2], dim=1)
        assert torch.equal(got, packed[:, [4, 1, 2]])
        if not r.direct:
            assert (r.read_calls, r.bytes_read) == (6, 3 * 3 * inner)
        with pytest.raises(ValueError, match="distinct"):
            r.read_experts("w", [1, 1], dim=1)
        with pytest.raises(ValueError, match="in \\[0, 6\\)"):
            r.read_experts("w", [6], dim=1)


# --- the page cache --------------------------------------------------------------------------------------------

def _resident_pages(path: Path, start: int, end: int) -> int:
    """Pages of [start, end) in the page cache: mincore(2) on a private mapping that is never touched (so
    probing faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    lo, hi = start // page * page, -(-end // page) * page
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    anchor = ctypes.c_char.from_buffer(mm)            # the mapping's address (no page is read)
    try:
        vec = (ctypes.c_ubyte * ((hi - lo) // page))()
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor) + lo), ctypes.c_size_t(hi - lo), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec)
    finally:
        del anchor
        mm.close()


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)                                   # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", MODES)
def test_reads_leave_nothing_in_the_page_cache(gpt_oss, mode):
    path = gpt_oss / "model.safetensors"
    name = "model.layers.1.mlp.experts.down_proj"
    start, end = _spans(path)[name]
    _evict(path)
    assert _resident_pages(path, start, end) == 0
    with open(path, "rb") as f:                        # the probe sees an ordinary buffered read
        f.seek(start)
        f.read(end - start)
    assert _resident_pages(path, start, end) > 0
    _evict(path)
    with _reader(path, mode) as r:
        r.read(name)
        r.read_experts(name, [0, 2])
        assert _resident_pages(path, start, end) == 0
        assert r.mechanism.startswith("O_DIRECT" if r.direct else "posix_fadvise DONTNEED")


def test_mechanism_is_reported(mixed):
    path, _ = mixed
    with SafetensorsReader(path) as auto, SafetensorsReader(path, direct=False) as buffered:
        assert auto.direct == _direct_ok(path.parent)
        assert auto.mechanism.startswith("O_DIRECT (page cache bypassed" if auto.direct else "posix_fadvise")
        assert "bounce buffer" in auto.mechanism if auto.direct else auto.bounce_bytes == 0
        assert buffered.mechanism == ("posix_fadvise DONTNEED (buffered reads into the destination; page cache "
                                      "released after each read)")
        assert not buffered.direct and buffered.bounce_bytes == 0


# --- a file changed after open ---------------------------------------------------------------------------------

@pytest.fixture
def copy(mixed, tmp_path) -> Path:
    """A copy of the mixed file whose mtime lies in the past, so that any later write changes it."""
    path, _ = mixed
    dest = tmp_path / "copy.safetensors"
    dest.write_bytes(path.read_bytes())
    os.utime(dest, ns=(10**18, 10**18))
    return dest


@pytest.mark.parametrize("mode", MODES)
def test_truncated_after_open_is_an_error_at_the_read(copy, mode):
    r = _reader(copy, mode)
    r.read("f32")
    os.truncate(copy, copy.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="changed after it was opened.*size") as err:
        r.read("experts")
    assert "load the model again" in str(err.value)
    r.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_short_read_is_an_error_never_garbage(copy, mode):
    # The file shrinks between the identity check and the read (a race the check cannot see): the short read
    # itself is refused.
    r = _reader(copy, mode)
    os.truncate(copy, _spans(copy)["experts"][0] + 10)
    r._identity = type(r._identity).of(os.stat(copy))
    with pytest.raises(CheckpointError, match="truncated"):
        r.read("experts")
    r.close()


@pytest.mark.parametrize("how", ["rewritten in place", "replaced", "deleted"])
def test_modified_after_open_is_an_error_at_the_read(copy, how):
    r = SafetensorsReader(copy)
    if how == "rewritten in place":                    # same size, other bytes
        with open(copy, "r+b") as f:
            f.seek(_spans(copy)["f32"][0])
            f.write(b"\xff" * 16)
        match = "mtime"
    elif how == "replaced":                            # a new file under the same name (a re-download)
        fresh = copy.with_name("fresh")
        fresh.write_bytes(copy.read_bytes())
        os.utime(fresh, ns=(10**18, 10**18))
        os.replace(fresh, copy)
        match = "inode"
    else:
        copy.unlink()
        match = "gone"
    with pytest.raises(CheckpointError, match=match):
        r.read("f32")
    r.close()


def test_a_file_that_is_not_safetensors_is_refused_at_open(tmp_path):
    for content, why in ((b"\x02", "shorter than"), ((10**9).to_bytes(8, "little") + b"{}", "header length"),
                         ((4).to_bytes(8, "little") + b"nope", "not JSON")):
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=why):
            SafetensorsReader(bad)


# --- several files ---------------------------------------------------------------------------------------------

def test_checkpoint_readers_map_every_key_to_its_shard(tmp_path):
    folder = make_tiny(tmp_path / "m", family="qwen3_moe", max_shard_size=40_000, **SMALL)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    by_key, readers = checkpoint_readers(folder, direct=False)
    try:
        assert len(readers) == len(set(weight_map.values())) > 2
        assert {k: r.path.name for k, r in by_key.items()} == weight_map
        for key in list(weight_map)[::7]:
            with safe_open(str(folder / weight_map[key]), "pt") as f:
                assert torch.equal(by_key[key].read(key), f.get_tensor(key))
    finally:
        for r in readers:
            r.close()


def test_bounce_pool_bounds_the_reads_in_flight():
    pool = BouncePool(2 * DIRECT_ALIGN, slots=2)
    a, b = pool.take(), pool.take()
    assert pool.bytes == 4 * DIRECT_ALIGN and a[0] is not b[0]
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got          # a third read waits for a buffer
    pool.give(a)
    waiter.join(5)
    assert got and got[0][0] is a[0] and pool.bytes == 4 * DIRECT_ALIGN   # reused, none made
    pool.give(b)
    pool.give(got[0])
    pool.close()
    assert pool.bytes == 0
    with pytest.raises(ValueError, match="multiple of 4096"):
        BouncePool(1000)


def test_readers_of_a_checkpoint_read_concurrently_through_one_shared_pool(tmp_path):
    folder = make_tiny(tmp_path / "m", family="qwen3_moe", max_shard_size=40_000, **SMALL)
    if not _direct_ok(folder):
        pytest.skip("this filesystem refuses O_DIRECT: there is no bounce pool (the fadvise reader reads in place)")
    by_key, readers = checkpoint_readers(folder, in_flight=3)
    pools = {id(r.bounce_pool) for r in readers}
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = os.preadv

    def slow_preadv(fd, bufs, off):          # every O_DIRECT read lasts a while, so reads overlap if they can
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.02)
            return real(fd, bufs, off)
        finally:
            with lock:
                in_flight[0] -= 1

    keys = [k for k in by_key if ".experts." in k][:12]
    want = {}
    for k in keys:
        with safe_open(str(by_key[k].path), "pt") as f:
            want[k] = f.get_tensor(k)
    try:
        assert len(pools) == 1 and readers[0].bounce_bytes == 0      # buffers are made when first needed
        os.preadv = slow_preadv
        try:
            with __import__("concurrent.futures").futures.ThreadPoolExecutor(6) as ex:
                got = dict(zip(keys, ex.map(lambda k: by_key[k].read(k), keys)))
        finally:
            os.preadv = real
        assert peak[0] == 3                   # three buffers: three reads at once, never more
        assert all(torch.equal(got[k], want[k]) for k in keys)
        assert readers[0].bounce_bytes == 3 * readers[0].bounce_pool.size and all(r.bounce_bytes == 0 for r in readers[1:])
    finally:
        for r in readers:
            r.close()


# --- reading the next layer ahead ------------------------------------------------------------------------------

class _Recording(SafetensorsReader):
    """Records (tensor, thread) of every read, and fails on the tensors in `fail`."""

    def __init__(self, *a, events, fail=(), **kw):
        super().__init__(*a, **kw)
        self.events, self.fail = events, set(fail)

    def read(self, name, out=None):
        self.events.append(("read", name, threading.current_thread().name))
        if name in self.fail:
            raise CheckpointError(f"injected failure reading {name}")
        return super().read(name, out)


def _dense_layers(reader) -> list[list[tuple[SafetensorsReader, str]]]:
    """Each decoder layer's dense tensors (everything but the routed experts), as the prefetcher takes them."""
    layers: dict[int, list] = {}
    for name in reader.tensors:
        parts = name.split(".")
        if parts[1] == "layers" and ".experts." not in name:
            layers.setdefault(int(parts[2]), []).append((reader, name))
    return [sorted(layers[i], key=lambda rn: rn[1]) for i in sorted(layers)]


def test_prefetch_reads_the_next_layer_on_the_worker_and_matches_safetensors(qwen):
    path = qwen / "model.safetensors"
    events: list = []
    reader = _Recording(path, direct=False, events=events)
    layers = _dense_layers(reader)
    assert len(layers) == 2 and all(len(g) >= 4 for g in layers)
    slot = max(sum(-(-reader.span(n).nbytes // 64) * 64 for _, n in g) for g in layers)
    ref = load_file(str(path))
    before = set(threading.enumerate())   # other tests' disk tiers may still hold their own workers
    with DensePrefetcher(layers) as pf:
        assert pf.slot_bytes == slot and pf.pool_bytes == 2 * slot     # exact, allocated once
        for step, i in enumerate((0, 1, 0, 1, 1)):
            events.append(("get", i))
            got = pf.get(i)
            assert sorted(got) == sorted(n for _, n in layers[i])
            assert all(torch.equal(t, ref[n]) for n, t in got.items())
            if step == 0:
                # Layer 1 is read ahead with no call from here: its last tensor arrives while we wait.
                last = layers[1][-1][1]
                deadline = time.monotonic() + 30
                while ("read", last, ANY) not in events and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert ("get", 1) not in events and ("read", last, ANY) in events
    threads = {e[2] for e in events if e[0] == "read"}
    assert len(threads) == 1 and threads.pop().startswith("moe-offload-disk")   # one worker, never the caller
    assert [e[1] for e in events if e[0] == "get"] == [0, 1, 0, 1, 1]
    assert not [t for t in threading.enumerate()
                if t not in before and t.name.startswith("moe-offload-disk")]   # its worker shut down
    with pytest.raises(RuntimeError, match="closed"):
        pf.get(0)
    reader.close()


def test_prefetch_errors_are_raised_in_the_caller(qwen):
    path = qwen / "model.safetensors"
    reader = _Recording(path, direct=False, events=[], fail={"model.layers.1.input_layernorm.weight"})
    pf = DensePrefetcher(_dense_layers(reader))
    pf.get(0)                                          # fine; layer 1 is now being read, and fails
    with pytest.raises(CheckpointError, match="injected failure reading model.layers.1"):
        pf.get(1)
    reader.fail.clear()
    assert torch.equal(pf.get(1)["model.layers.1.input_layernorm.weight"],
                       load_file(str(path))["model.layers.1.input_layernorm.weight"])  # recovers on retry
    pf.close()
    reader.close()


def test_prefetch_pool_comes_from_the_allocator(qwen):
    reader = SafetensorsReader(qwen / "model.safetensors", direct=False)
    asked = []

    def allocate(n):
        asked.append(n)
        return torch.zeros(n, dtype=torch.uint8)

    with DensePrefetcher(_dense_layers(reader), allocate=allocate) as pf:
        assert asked == [pf.slot_bytes] * 2
    with pytest.raises(ValueError, match="contiguous uint8"):
        DensePrefetcher(_dense_layers(reader), allocate=lambda n: torch.zeros(n, dtype=torch.float32))
    reader.close()
