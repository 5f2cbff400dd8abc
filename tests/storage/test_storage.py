"""The host tier: exact-size slabs, ownership by address, device resolution, and the CUDA pinning logic
(driven through a stand-in for torch.cuda.cudart(), since this machine has no GPU)."""

import contextlib
import gc

import pytest
import torch

from moe_offload.errors import DeviceError
from moe_offload.storage.host import HostArena, accelerator_available, resolve_device


def test_cpu_arena_is_exact_size_and_sub_allocated():
    arena = HostArena(torch.device("cpu"), want_uva=True)
    # 3 fp32 tensors: 100 B (25 values), 64 B, 2 B (one fp16). 16-byte alignment: 100 -> 112, 112+64 = 176, +2 = 178.
    out = arena.allocate("layer 0", [("a", (25,), torch.float32), ("b", (4, 4), torch.float32),
                                     ("c", (1,), torch.float16)])
    assert arena.nbytes == 178 and len(arena.slabs) == 1
    for name, (host, visible) in out.items():
        assert host is visible  # no accelerator: the host tensor is what the model holds
        assert arena.owns(host)
    assert out["b"][0].data_ptr() - out["a"][0].data_ptr() == 112
    assert out["b"][0].shape == (4, 4) and out["c"][0].dtype == torch.float16
    assert not arena.owns(torch.zeros(4))
    assert "no accelerator" in arena.mechanism


def test_writes_land_in_the_slab():
    arena = HostArena(torch.device("cpu"), want_uva=False)
    (host, _), = arena.allocate("r", [("w", (2, 3), torch.float32)]).values()
    host.copy_(torch.arange(6.0).view(2, 3))
    assert torch.equal(arena.slabs[0].host[:24].view(torch.float32), torch.arange(6.0))


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    if not accelerator_available():
        assert resolve_device(None) == torch.device("cpu")
        with pytest.raises(DeviceError, match="not available"):
            resolve_device("cuda")
        with pytest.raises(DeviceError, match="not available"):
            resolve_device("cuda:3")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("gpu0")
    with pytest.raises(DeviceError, match="meta"):
        resolve_device("meta")


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; returns the error code it is told to."""

    def __init__(self, register_error=0):
        self.register_error = register_error
        self.registered: dict[int, int] = {}
        self.calls = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if self.register_error:
            return self.register_error
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 712

    def cudaGetErrorString(self, err):
        return {2: "cudaErrorMemoryAllocation"}.get(err, f"error {err}")


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return fake


def test_pinned_slab_is_registered_at_exact_size_and_released(fake_cuda):
    arena = HostArena(torch.device("cuda"), want_uva=False)  # prefetch: pinned, no view
    arena.allocate("layer 0", [("a", (10,), torch.float32), ("b", (3,), torch.float32)])
    # 256-byte alignment on an accelerator: 40 B -> 256, + 12 B = 268 B, registered as exactly that.
    (kind, ptr, size, flags), = fake_cuda.calls
    assert (kind, size, flags) == ("register", 268, 3) and ptr == arena.slabs[0].host.data_ptr()
    assert arena.slabs[0].registered and "pinned" in arena.mechanism
    arena.release()
    assert fake_cuda.calls[-1] == ("unregister", ptr) and fake_cuda.registered == {} and arena.slabs == []


def test_collected_arena_unpins_its_slabs(fake_cuda):
    arena = HostArena(torch.device("cuda"), want_uva=False)
    arena.allocate("r", [("a", (4,), torch.float32)])
    assert len(fake_cuda.registered) == 1
    del arena
    gc.collect()
    assert fake_cuda.registered == {}


def test_failed_pinning_is_a_clear_device_error(fake_cuda):
    fake_cuda.register_error = 2
    arena = HostArena(torch.device("cuda"), want_uva=False)
    with pytest.raises(DeviceError, match="cudaErrorMemoryAllocation.*lower --offload-gb"):
        arena.allocate("r", [("a", (4,), torch.float32)])
    assert arena.slabs == []


def test_pinning_without_cuda_is_loud(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    arena = HostArena(torch.device("xpu"), want_uva=False)
    with pytest.raises(DeviceError, match="needs CUDA"):
        arena.allocate("r", [("a", (4,), torch.float32)])
