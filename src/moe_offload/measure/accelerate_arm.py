"""The `accelerate` bench arm: the peer users reach for first, measured by bench's own instrument (timing.py).

`transformers` `from_pretrained(folder, device_map="auto", max_memory=..., offload_folder=...)`: accelerate
places whole modules (decoder layers are never split) in module order, device first, then host memory,
then disk; at every forward, a hook loads *all* weights of each offloaded module (from host memory, from
the checkpoint file, or from the copy it re-saved in `offload_folder` for tensors it converts at load, e.g.
fused MoE experts) and drops them afterwards.

The budget is the bench's: the device may hold what the bench's plan keeps resident,
`plan.total_bytes - plan.budget_bytes` (`--offload-gb X`: all but X GiB; `--device-memory X`: X minus the
reserve), so every arm leaves the same number of bytes off the device.

- accelerator: `max_memory = {device index: that, "cpu": host}`, host = `host_memory_bytes` when given,
  else the RAM available at load time; what fits neither goes to disk.
- CPU only: the device *is* host memory: `max_memory = {"cpu": that}`, and the rest goes to disk.

Bytes per token are measured, never derived from sizes:

- `disk_read_bytes`: `/proc/self/io` `read_bytes` (bytes the process made the storage deliver) over each
  decode step. Before each step, outside the timed interval, the page cache of the checkpoint files and
  the offload folder is released (POSIX_FADV_DONTNEED, the disk tier's own mechanism), so a re-read counts
  as a disk read; pages accelerate keeps memory-mapped cannot be released and are then served from memory
  (they show in its peak RSS instead).
- `loaded_bytes`: the bytes accelerate's offload hooks load per step (every tensor of each offloaded
  module at each of its forwards), counted by a forward pre-hook on those modules.
- `host_link_bytes`: on an accelerator, the loaded bytes (each crosses the host link); 0 on a CPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MoeOffloadError
from . import timing   # timing.greedy looked up at each run: one instrument (or a stand-in) for every arm
from .timing import batch_prompts, measured_link_bytes, peak_rss_bytes, reset_peak_rss, timing_fields

__all__ = ["max_memory_for", "AccelerateArm", "DISK_MEASUREMENT"]

DISK_MEASUREMENT = ("/proc/self/io read_bytes over each decode step; page cache of the checkpoint files and the "
                    "offload folder released (POSIX_FADV_DONTNEED) before each step, outside the timed interval")


def max_memory_for(plan, device: torch.device, *, host_memory_bytes: int | None = None) -> dict:
    """accelerate's `max_memory` at the budget of `plan` (see the module docstring)."""
    device_bytes = plan.total_bytes - plan.budget_bytes
    if device.type == "cpu":
        return {"cpu": device_bytes}
    if host_memory_bytes is None:
        import psutil

        host_memory_bytes = psutil.virtual_memory().available
    return {device.index or 0: device_bytes, "cpu": int(host_memory_bytes)}


def _read_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Step:
    disk: int
    loaded: int


@dataclass
class AccelerateArm:
    """One accelerate-loaded model, its offload folder and its per-step meter (the bench's `meter` protocol:
    `reset()` at each run, `before_step()` untimed before each forward, `step()` -> link bytes of it)."""

    model: object
    max_memory: dict
    offload_dir: Path
    device: torch.device
    files: list[Path]
    runs: list[list[_Step]] = field(default_factory=list)
    _loaded: int = 0
    _io: int = 0
    _handles: list = field(default_factory=list)

    @classmethod
    def load(cls, folder: str | os.PathLike, plan, device: torch.device, *, dtype: str | None = None,
             host_memory_bytes: int | None = None, offload_root: str | os.PathLike | None = None) -> "AccelerateArm":
        import transformers

        from ..model.config import DTYPE_NAMES, read_config

        if _read_bytes() is None:
            raise MoeOffloadError("the accelerate arm measures disk reads with /proc/self/io, which this system "
                                  "does not have (Linux only); drop accelerate from --arms")
        folder = Path(folder)
        config = read_config(folder)
        # The Auto class moe_offload's own loader builds (model/config.build_meta_model): vision models are
        # image-text-to-text in transformers 5, everything else a causal LM.
        auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else \
            transformers.AutoModelForCausalLM
        max_memory = max_memory_for(plan, device, host_memory_bytes=host_memory_bytes)
        offload_dir = Path(tempfile.mkdtemp(prefix="moe-offload-accelerate-", dir=offload_root))
        try:
            model = auto.from_pretrained(folder, device_map="auto", max_memory=max_memory,
                                         offload_folder=str(offload_dir), local_files_only=True,
                                         dtype=getattr(torch, DTYPE_NAMES[dtype]) if dtype else "auto")
        except BaseException:
            shutil.rmtree(offload_dir, ignore_errors=True)
            raise
        model.eval()
        files = sorted(folder.glob("*.safetensors")) + sorted(p for p in offload_dir.rglob("*") if p.is_file())
        for path in files:  # dirty pages cannot be released: write back what accelerate just re-saved
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        arm = cls(model, max_memory, offload_dir, device, files)
        arm._count_hook_loads()
        return arm

    # --- meter -------------------------------------------------------------------------------

    def _count_hook_loads(self) -> None:
        from accelerate.utils import named_module_tensors

        for _, module in self.model.named_modules():
            hook = getattr(module, "_hf_hook", None)
            for h in getattr(hook, "hooks", [hook]):     # a SequentialHook holds several
                if getattr(h, "offload", False):
                    n = sum(_tensor_bytes(t) for _, t in named_module_tensors(
                        module, include_buffers=h.offload_buffers, recurse=h.place_submodules,
                        remove_non_persistent=True))
                    self._handles.append(module.register_forward_pre_hook(
                        lambda *_, n=n: setattr(self, "_loaded", self._loaded + n)))

    def reset(self) -> None:
        self.runs.append([])

    def before_step(self) -> None:
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self._loaded, self._io = 0, _read_bytes()

    def step(self) -> int:
        """Link bytes of the forward since `before_step`: disk reads, plus host-link loads on an accelerator."""
        disk = _read_bytes() - self._io
        if not self.runs:
            self.runs.append([])
        self.runs[-1].append(_Step(disk, self._loaded))
        return disk + self._host_link(self._loaded)

    def _host_link(self, loaded: int) -> int:
        return 0 if self.device.type == "cpu" else loaded

    def per_token(self, c: int, *, skip_first_run: bool = True) -> dict[str, float]:
        """Disk, host-link and hook-loaded bytes per token over the measured runs' decode steps."""
        steps = [s for run in (self.runs[1:] if skip_first_run else self.runs) for s in run]
        if not steps:
            return {"disk_read_bytes_per_token": 0.0, "host_link_bytes_per_token": 0.0,
                    "offload_loaded_bytes_per_token": 0.0}
        n = len(steps) * c
        return {"disk_read_bytes_per_token": sum(s.disk for s in steps) / n,
                "host_link_bytes_per_token": sum(self._host_link(s.loaded) for s in steps) / n,
                "offload_loaded_bytes_per_token": sum(s.loaded for s in steps) / n}

    # --- read-back ---------------------------------------------------------------------------

    def bytes_by_placement(self) -> dict[str, int]:
        """Weight bytes per placement of `hf_device_map` ("cpu", "disk", or the device index), read back from
        the loaded model: each parameter and persistent buffer (what a plan counts) under the deepest map entry
        that contains it."""
        device_map = dict(self.model.hf_device_map)
        out: dict[str, int] = {}
        tensors = list(self.model.named_parameters())
        for path, module in self.model.named_modules():
            tensors += [(f"{path}.{n}" if path else n, b) for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set]
        for name, t in tensors:
            parts = name.split(".")
            place = next((device_map[".".join(parts[:i])] for i in range(len(parts), -1, -1)
                          if ".".join(parts[:i]) in device_map), None)
            key = str(place)
            out[key] = out.get(key, 0) + _tensor_bytes(t)
        return out

    def settings(self, budget_bytes: int) -> dict:
        by_place = self.bytes_by_placement()
        return {
            "policy": "accelerate (device_map='auto': whole modules in module order, device, then cpu, then disk)",
            "engine": f"transformers {__import__('transformers').__version__} + accelerate "
                      f"{__import__('accelerate').__version__}",
            "budget_bytes": budget_bytes,
            "backend": "accelerate hooks",
            "max_memory": {str(k): v for k, v in self.max_memory.items()},
            "offload_folder": str(self.offload_dir),
            "device": str(self.device),
            "hf_device_map": {k: str(v) for k, v in self.model.hf_device_map.items()},
            "bytes_by_placement": by_place,
            "disk_measurement": DISK_MEASUREMENT,
            "threads": torch.get_num_threads(),
        }

    def offloaded_bytes(self) -> int:
        """Bytes not on the compute device (disk only, on a CPU: host memory is the device there)."""
        resident = {"cpu"} if self.device.type == "cpu" else {str(self.device.index or 0), str(self.device)}
        return sum(v for k, v in self.bytes_by_placement().items() if k not in resident)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.model = None
        shutil.rmtree(self.offload_dir, ignore_errors=True)


# --- the bench rows -------------------------------------------------------------------------------

MECHANISM = ("accelerate AlignDevicesHook: every weight of an offloaded module is loaded at each of its forwards "
             "(cpu: from host memory; disk: from the checkpoint file, or the copy re-saved in the offload folder)")


def bench_rows(folder, plan, device: torch.device, *, dtype, tokenizer, levels, prompts, same_prompt: bool,
               runs: int, max_new_tokens: int, link_gbps, budget_label: str, describe, advance) -> list[dict]:
    """bench's rows for the accelerate arm: loaded once at the budget of `plan`, then per concurrency level one
    warm-up run (discarded) and `runs` measured runs of bench's own greedy loop (`timing.greedy`)."""
    import gc
    import math

    tracked = reset_peak_rss()
    arm = AccelerateArm.load(folder, plan, device, dtype=dtype)
    rows = []
    try:
        for c in levels:
            batch = batch_prompts(prompts, c, same_prompt)
            enc = tokenizer(batch, return_tensors="pt", padding=True).to(device)
            arm.runs = []
            measured = []
            with torch.no_grad():
                for i in range(runs + 1):
                    describe(f"c={c} " + ("warm-up" if i == 0 else f"run {i}/{runs}"))
                    arm.reset()
                    run = timing.greedy(arm.model, enc, max_new_tokens, device, meter=arm)
                    if i > 0:
                        measured.append(run)
                    advance()
            link = measured_link_bytes(c, measured)
            split = arm.per_token(c)
            assert math.isclose(link, split["disk_read_bytes_per_token"] + split["host_link_bytes_per_token"],
                                rel_tol=1e-9, abs_tol=1e-6)
            by_place = arm.bytes_by_placement()
            row = {
                **timing_fields("accelerate", c, measured, max_new_tokens),
                "offloaded_bytes": arm.offloaded_bytes(),          # read back from hf_device_map
                "link_bytes_per_token": link,                       # disk reads + host-link loads, measured
                **split,
                "link_measurement": DISK_MEASUREMENT + "; host link (accelerator only): the bytes accelerate's "
                                    "offload hooks load per step",
                "host_bytes": by_place.get("cpu", 0) if device.type != "cpu" else 0,
                "device_bytes": sum(v for k, v in by_place.items() if k not in ("cpu", "disk"))
                if device.type != "cpu" else by_place.get("cpu", 0),
                "disk_bytes": by_place.get("disk", 0),
                "same_prompt": same_prompt,
                "prompts": batch,
                "mechanism": MECHANISM,
                "model": Path(folder).resolve().name,
                "model_type": plan.model_type,
                "budget": budget_label,
                "settings": arm.settings(plan.budget_bytes),
            }
            if link_gbps:
                row["link_ms_per_token"] = link / (link_gbps * 1e9) * 1e3
            rows.append(row)
    finally:
        arm.close()
        gc.collect()
    peak = peak_rss_bytes() if tracked else None
    for row in rows:   # over the arm's whole life: load, every level, every run
        row["peak_rss_bytes"] = peak
    return rows
