"""make-tiny's writing: a model's folder from its config, built on the meta device and streamed to disk.

`write_model` draws the weights (seeded) and writes them tensor by tensor (formats/stream_save.py: memory of about
one layer), the released on-disk orientation where it departs from save_pretrained's (released.py), the quantized
rewrite (quantize.py), the tokenizer and moe_offload_tiny.json, into a temporary sibling folder renamed into place
at the end: on any error nothing is left. make.py (make_tiny) and make_like.py (make_like) decide what to write.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .families import AUTO_CLASSES, RELEASED_TRANSPOSED

__all__ = ["Quantize", "write_model", "check_target"]


def check_target(out: Path) -> None:
    """Refuse a target make_tiny could not fill, before anything is built: FileExistsError (a file, or a
    non-empty folder), NotADirectoryError (a path through a file), PermissionError (nowhere to write)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(
            f"cannot write a tiny model to {out}: it exists and is not a directory. "
            "Fix: choose a new path or remove that file."
        )
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"cannot write a tiny model to {out}: the directory is not empty and make_tiny never "
            "overwrites existing files. Fix: choose a new or empty directory, or delete this one first."
        )
    # The folder is built next to `out` and renamed into place: its nearest existing ancestor must be a
    # directory we can create things in. Probed by doing it, since permission bits say nothing for root
    # (or on read-only and virtual file systems such as /sys).
    base = out.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise NotADirectoryError(
            f"cannot write a tiny model to {out}: {base} is a file, not a directory. "
            "Fix: choose a path whose parents are directories."
        )
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=base)
    except OSError as exc:
        raise PermissionError(
            f"cannot write a tiny model to {out}: nothing can be created in {base} ({exc.strerror}). "
            "Fix: choose a directory you can write to."
        ) from exc
    os.rmdir(probe)


@dataclass(frozen=True)
class Quantize:
    """How write_model quantizes: the format, `modules_to_not_convert`, the FP8 block (None: the largest that
    tiles), and `released`: a released quantization_config whose fields the written one keeps."""

    quant: str
    skips: list[str] | None
    block: tuple[int, int] | None = None
    released: dict[str, Any] | None = None


def write_model(out: Path, *, family: str, config: Any, dtype: str, tokenizer: Any, generation: dict[str, Any],
                record: dict[str, Any], seed: int, quantize: Quantize | None = None,
                config_json: dict[str, Any] | None = None, generation_json: dict[str, Any] | None = None,
                max_shard_size: int | str = "50GB", progress: bool | None = None) -> Path:
    """Build `config`'s model on the meta device and write the folder `out` (already checked by check_target):
    weights drawn from `seed` in `dtype`, streamed; `generation` the generation config's fields; the `tokenizer`;
    `record` as moe_offload_tiny.json. `config_json` / `generation_json`: the exact config.json /
    generation_config.json to write instead of transformers' serialization of them (a released model's, with
    every field it has; `quantization_config` is then added to it). Atomic: built in a temporary sibling, then
    renamed into place; on any error nothing is left."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from ..formats.stream_save import meta_model

    auto_cls = getattr(transformers, AUTO_CLASSES[family])
    # The model as from_pretrained(dtype=...) would hold it, on the meta device: no weight exists
    # yet; each is drawn, written and freed in turn by _write_weights.
    model = meta_model(auto_cls, config, getattr(torch, dtype))
    model.generation_config = GenerationConfig(**{k: v for k, v in generation.items() if v is not None})

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # mkdtemp creates the folder 0700; give the final folder ordinary permissions.
        tmp.chmod(0o755)
        _write_weights(model, tmp, seed=seed, max_shard_size=max_shard_size,
                       progress=_stderr_is_terminal() if progress is None else progress)
        if config_json is not None:
            _write_json(tmp / "config.json", config_json)
        if generation_json is not None:
            _write_json(tmp / "generation_config.json", generation_json)
        if family in RELEASED_TRANSPOSED:
            from .released import transpose_in_place

            transpose_in_place(tmp, RELEASED_TRANSPOSED[family])
        if quantize is not None:
            from ..formats.quant import QuantFormat
            from .quantize import quantize_checkpoint

            quantize_checkpoint(tmp, model, QuantFormat(quantize.quant), modules_to_not_convert=quantize.skips,
                                block=quantize.block)
            if quantize.released:
                cfg = json.loads((tmp / "config.json").read_text())
                cfg["quantization_config"] = {**cfg["quantization_config"], **quantize.released}
                _write_json(tmp / "config.json", cfg)
        tokenizer.save_pretrained(tmp)
        _write_json(tmp / "moe_offload_tiny.json", record)
        check_target(out)  # someone may have filled it while we were building
        try:
            # POSIX rename atomically replaces an empty directory.
            os.replace(tmp, out)
        except OSError:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # platforms where rename cannot replace a directory
                os.replace(tmp, out)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr is not None and sys.stderr.isatty()


def _write_weights(model: Any, dest: Path, *, seed: int, max_shard_size: int | str, progress: bool) -> None:
    """Stream the weights of meta-device ``model`` into ``dest`` (config and generation config too).

    Every floating tensor is drawn in float32 and rounded to its stored dtype, so the
    float16/bfloat16 checkpoints are roundings of the very same weights as the float32 one.
    """
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from ..formats.stream_save import save_streaming

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("make-tiny: writing weights", total=None)

        def advance(done: int, total: int, key: str) -> None:
            where = ".".join(key.split(".")[:3])   # model.layers.7: the decoder layer being written
            bar.update(task, completed=done, total=total, description=f"make-tiny: {where}")

        # fork_rng: seed only for our own draws, leaving the caller's global RNG state as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            save_streaming(model, dest, max_shard_size=max_shard_size, progress=advance)
