"""The host tier: exact-size host memory for offloaded weights, and device-visible views of it.

This is the only module that touches accelerator-specific memory APIs; everything in it
that needs CUDA is small and says so.

Why exact size: a caching host allocator rounds each request up to a power of two (a
305 GiB offload once took 504 GiB of host RAM and was OOM-killed). We allocate one plain
host slab per region (a decoder layer, say), sub-allocate tensors in it at their natural
alignment, and pin the slab in place with `cudaHostRegister`, which neither rounds nor
caches. Host memory used equals the offloaded bytes plus a few bytes of alignment.

Mechanisms, reported as they are (never a silent fallback):
- `pinned+uva`: CUDA, slab registered as mapped pinned memory; kernels read it in place
  through a CUDA tensor made from the slab's address (`__cuda_array_interface__`, a public
  protocol torch consumes zero-copy). The view's address is stable (CUDA-graph friendly).
- `pinned`: CUDA, registered but not mapped into a view (the prefetch backend copies from it).
- `host`: no accelerator: the host tier is ordinary memory; both backends still run so
  their logic is exercised everywhere.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .clib import libc_function
from .huge_pages import advise_huge

# Sub-allocation alignment: 256 bytes on an accelerator (what its kernels and DMA engines read
# fastest, and what its own allocator guarantees, so kernel choice matches resident weights);
# 16 on the CPU, enough for vector loads while padding stays far below 1% on tiny models.
_ALIGN_DEVICE, _ALIGN_CPU = 256, 16


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    return bool(acc is not None and acc.is_available())


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: the accelerator when there is one, else cpu; a named device must exist."""
    from ..errors import DeviceError

    if device is None:
        if accelerator_available():
            return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"{device!r} is not a device name: use cpu, cuda, cuda:1, xpu, ...") from exc
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise DeviceError("meta is not a device to run on: use cpu or an accelerator")
    acc = torch.accelerator.current_accelerator() if accelerator_available() else None
    if acc is None or acc.type != dev.type:
        raise DeviceError(f"device {device!r} is not available on this machine (accelerator: "
                          f"{acc.type if acc else 'none'}); use --device cpu or leave --device out")
    count = torch.accelerator.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceError(f"device {device!r} does not exist: this machine has {count} {dev.type} device(s)")
    return dev


def set_tensor(root: nn.Module, path: str, tensor: torch.Tensor, *, is_buffer: bool | None = None) -> None:
    """Put `tensor` at dotted `path` under `root`, as a buffer if one is there (or `is_buffer`), else as a
    frozen Parameter. The one way the loader, the runtime and transforms swap weights."""
    owner_name, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if is_buffer if is_buffer is not None else leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    else:
        owner._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else \
            nn.Parameter(tensor, requires_grad=False)


class StagedParameters:
    """One nn.Parameter per staged slot (a module's weight that a hook swaps a staged copy in for during a call),
    its data rebound each call: hooks create no Parameter per call. Buffers and Parameters (a restored home
    weight) go in as set_tensor puts them."""

    def __init__(self):
        self._params: dict[tuple[int, str], nn.Parameter] = {}

    def put(self, root: nn.Module, path: str, tensor: torch.Tensor) -> None:
        owner_name, _, leaf = path.rpartition(".")
        owner = root.get_submodule(owner_name) if owner_name else root
        if leaf in owner._buffers or isinstance(tensor, nn.Parameter):
            set_tensor(owner, leaf, tensor)
            return
        key = (id(owner), leaf)
        param = self._params.get(key)
        if param is None or param.dtype != tensor.dtype or param.device != tensor.device:
            param = self._params[key] = nn.Parameter(tensor, requires_grad=False)
        else:
            param.data = tensor
        owner._parameters[leaf] = param

    def clear(self) -> None:
        self._params.clear()


@dataclass(frozen=True)
class ExpertSplit:
    """A fused routed-expert tensor [E, ...] with any subset of its experts in host memory.

    The model holds the *host stack*: the experts `host_ids` (ascending) as consecutive rows of a
    host slab. `resident` is the *resident stack* on the device: the other experts, ascending. The
    index map says where expert e lives: `on_host[e]` (which stack) and `row[e]` (its row there);
    both are device tensors, so the experts function looks routed ids up without a host round trip.
    """

    resident: torch.Tensor              # [E - len(host_ids), ...] on the device
    host_ids: tuple[int, ...]           # ascending, distinct, in [0, num_experts)
    num_experts: int
    on_host: torch.Tensor = field(init=False, repr=False, compare=False)   # [E] bool
    row: torch.Tensor = field(init=False, repr=False, compare=False)       # [E] int64
    resident_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)   # the others, ascending
    # The same index map on the host, for the loader's per-checkpoint-tensor lookups (no device round trip,
    # no O(E) search per expert): expert e -> (tier, row in that tier's stack).
    _places: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        from ..planning.placement import Tier

        host = set(self.host_ids)
        resident = tuple(e for e in range(self.num_experts) if e not in host)
        places = [None] * self.num_experts
        for tier, ids in ((Tier.HOST.value, self.host_ids), (Tier.DEVICE.value, resident)):
            for row, e in enumerate(ids):
                places[e] = (tier, row)
        on_host = torch.zeros(self.num_experts, dtype=torch.bool)
        on_host[list(self.host_ids)] = True
        row = torch.tensor([r for _, r in places], dtype=torch.long)
        object.__setattr__(self, "resident_ids", resident)
        object.__setattr__(self, "_places", tuple(places))
        object.__setattr__(self, "on_host", on_host.to(self.resident.device))
        object.__setattr__(self, "row", row.to(self.resident.device))

    def where(self, expert: int) -> tuple[str, int]:
        """(tier, row in that tier's stack) of one expert."""
        return self._places[expert]


def expert_runs(ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first row, first expert, count) of each run of consecutive expert ids: a stack's rows are filled
    from a tensor that spans every expert by one slice copy per run (one for a whole tensor)."""
    return row_runs(list(range(len(ids))), list(ids))


def row_runs(positions: list[int], rows: list[int]) -> list[tuple[int, int, int]]:
    """(first position, first row, count) of each run where both positions and rows go up by one: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for p, r in zip(positions, rows):
        if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == r:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((p, r, 1))
    return runs


@dataclass
class Slab:
    region: str
    host: torch.Tensor               # uint8, the whole slab in host memory
    registered: bool = False         # cudaHostRegister'ed (pinned)
    view: torch.Tensor | None = None  # uint8 device-visible view of the same bytes (uva), else None

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        for base in (self.host, self.view):
            if base is not None and base.data_ptr() <= start and end <= base.data_ptr() + base.numel():
                return True
        return False


@dataclass
class HostArena:
    """Exact-size host slabs for one model's offloaded tensors."""

    device: torch.device
    want_uva: bool
    slabs: list[Slab] = field(default_factory=list)

    def __post_init__(self):
        # Registered memory must be unregistered before it is freed: when the arena (and so the
        # model holding it) is collected, or on release(), whichever comes first.
        self._finalizer = weakref.finalize(self, _release_slabs, self.slabs)

    @property
    def mechanism(self) -> str:
        if self.device.type == "cpu":
            return "host (no accelerator: the host tier is ordinary memory)"
        return "pinned+uva (mapped pinned host memory read in place)" if self.want_uva else \
            "pinned (host memory staged onto the device)"

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    def allocate(self, region: str, specs: list[tuple[str, tuple[int, ...], torch.dtype]]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One slab for `specs` [(name, shape, dtype)].

        Returns name -> (host tensor, device-visible tensor): the same tensor without an
        accelerator or without uva, else the host tensor and its zero-copy device view.
        """
        align = _ALIGN_CPU if self.device.type == "cpu" else _ALIGN_DEVICE
        offsets, cursor = [], 0
        for _, shape, dtype in specs:
            cursor = -(-cursor // align) * align
            offsets.append(cursor)
            cursor += math.prod(shape) * dtype.itemsize
        host = torch.empty(cursor, dtype=torch.uint8)  # plain malloc-backed memory: exact size
        advise_huge(host)   # in 2 MiB pages where the kernel allows: host compute streams these bytes
        slab = Slab(region, host)
        if self.device.type != "cpu":
            _pin(slab, self.device)
            if self.want_uva:
                slab.view = _device_view(slab.host, self.device)
        self.slabs.append(slab)
        out = {}
        for (name, shape, dtype), off in zip(specs, offsets):
            n = math.prod(shape) * dtype.itemsize
            host_t = slab.host[off:off + n].view(dtype).view(shape)
            view_t = slab.view[off:off + n].view(dtype).view(shape) if slab.view is not None else host_t
            out[name] = (host_t, view_t)
        return out

    def owns(self, t: torch.Tensor) -> bool:
        return any(s.contains(t) for s in self.slabs)

    def host_alias(self, t: torch.Tensor) -> torch.Tensor:
        """The host tensor behind a device-visible view of one of the slabs (uva): the same bytes, for the CPU to
        read in place (host compute). A cpu tensor is its own."""
        if t.device.type == "cpu":
            return t
        for slab in self.slabs:
            if slab.view is not None and slab.contains(t):
                off = t.data_ptr() - slab.view.data_ptr()
                return slab.host[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        raise ValueError(f"a {tuple(t.shape)} tensor on {t.device} is not a view of this arena's host memory")

    def release(self) -> None:
        """Unpin and drop every slab now (only once nothing reads the model's offloaded weights)."""
        self._finalizer()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim), so that a closed model's memory leaves
    the process's RSS: tensors below glibc's mmap threshold come from the heap, which keeps freed pages. False
    where the C library has no malloc_trim (not glibc): nothing to do there."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def _release_slabs(slabs: list[Slab]) -> None:
    for slab in slabs:
        if slab.registered:
            _unpin(slab)
    slabs.clear()


# --- CUDA-only pieces: small on purpose; exercised by benchmarks/gpu_check.py on a GPU -----

def _pin(slab: Slab, device: torch.device) -> None:
    """Page-lock the slab in place (exact size, no caching allocator) and map it for the device."""
    from ..errors import DeviceError

    if not hasattr(torch, "cuda") or not torch.cuda.is_available():
        raise DeviceError("pinned host memory needs CUDA here; this accelerator has no cudaHostRegister "
                          "(run with --backend prefetch, or --device cpu)")
    cudart = torch.cuda.cudart()
    # Registered under the target device, so the driver maps it for that device (multi-GPU machines).
    # cudaHostRegisterPortable (1) | cudaHostRegisterMapped (2): usable from every device, mapped for UVA.
    with torch.cuda.device(device):
        err = _code(cudart.cudaHostRegister(slab.host.data_ptr(), slab.nbytes, 3))
    if err != 0:
        name = getattr(cudart, "cudaGetErrorString", lambda e: f"error {e}")(err)
        raise DeviceError(f"cudaHostRegister of {slab.nbytes} bytes failed ({name}): pinning host memory for "
                          "the offloaded weights failed; lower --offload-gb, raise the memlock limit, or use "
                          "--device cpu")
    slab.registered = True


def _code(result) -> int:
    """cudart bindings return a cudaError (an int-like enum), or a tuple led by one in some builds."""
    return int(result[0] if isinstance(result, tuple) else result)


def _unpin(slab: Slab) -> None:
    err = _code(torch.cuda.cudart().cudaHostUnregister(slab.host.data_ptr()))
    slab.registered = err != 0  # on failure the pages stay pinned; the slab keeps saying so


class _CudaArray:
    """A `__cuda_array_interface__` over mapped pinned memory: torch builds a CUDA tensor on it, zero-copy.

    Under unified virtual addressing (every 64-bit CUDA platform) the device address of
    registered, mapped host memory equals its host address.
    """

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int):
        self._owner = owner  # the view keeps this object, and so the host memory, alive
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    from ..errors import DeviceError

    try:
        with torch.cuda.device(device):
            view = torch.as_tensor(_CudaArray(host, host.data_ptr(), host.numel()), device=device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"this torch cannot make a zero-copy CUDA view of pinned host memory ({exc}); "
                          "use --backend prefetch, which stages offloaded weights instead") from exc
    if view.data_ptr() != host.data_ptr():
        raise DeviceError("the CUDA view of pinned host memory is a copy, not an alias, on this torch: uva would "
                          "de-offload every weight; use --backend prefetch")
    return view


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor (float8) as its bytes: gathers and scatters then work on every device (CPU torch
    has no index_copy_ for float8)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t
