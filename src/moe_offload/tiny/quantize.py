"""make-tiny --quant: a saved checkpoint rewritten in the quantized on-disk format the released models use.

FP8 e4m3 + `weight_scale_inv` block scales (DeepSeek-V3, Qwen3-FP8) or gpt-oss MXFP4 experts (`_blocks` /
`_scales`), with the encodings of formats/quant_codecs.py and the `quantization_config` of formats/quant.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from ..formats.layouts import map_keys
from ..formats.quant import QuantFormat, QuantSpec
from ..formats.quant_codecs import SCALE_SUFFIX, quantize_fp8, quantize_mxfp4

__all__ = ["quantize_checkpoint"]


def _largest_block(sizes, cap: int = 128) -> int:
    """The largest power of two <= cap that divides every size."""
    b = cap
    while any(n % b for n in sizes):
        b //= 2
    return b


def quantize_checkpoint(folder, model: torch.nn.Module, fmt: QuantFormat, *,
                        modules_to_not_convert: Sequence[str] | None = None,
                        block: tuple[int, int] | None = None) -> QuantSpec:
    """Rewrite the safetensors files `save_pretrained(model)` wrote in `folder` into `fmt`, as the released
    checkpoints store it, and add the `quantization_config` to its config.json. Returns the spec written.

    FP8: the 2-d weights of the modules transformers' FP8 integration converts (every `nn.Linear` and
    per-expert matrix outside `modules_to_not_convert`, whose default keeps the LM head) become e4m3 +
    `weight_scale_inv`; `block` None picks the largest power-of-two block up to 128x128 that tiles all of
    them exactly. MXFP4: the fused `experts.gate_up_proj` / `down_proj` become `_blocks` + `_scales`;
    biases and everything else stay as they were."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    folder = Path(folder)
    skip = list(modules_to_not_convert) if modules_to_not_convert is not None else get_keys_to_not_convert(model)
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or ())  # as transformers' quantizers add them
    convert = {name for name, m in model.named_modules()
               if (type(m) is torch.nn.Linear or name.endswith(".experts")) and should_convert_module(name, skip)}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files[path] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())

    # Checkpoint names are not always the in-memory ones (Mixtral's `block_sparse_moe.experts.3.w1`):
    # decide by the in-memory tensor each key lands in.
    slots = map_keys(model, [k for state, _ in files.values() for k in state])

    def fp8_target(key: str, t: torch.Tensor) -> bool:
        return (key.endswith(".weight") and t.ndim == 2 and t.is_floating_point()
                and slots[key].target.rpartition(".")[0] in convert)

    def mxfp4_target(key: str, t: torch.Tensor) -> bool:
        module, _, param = slots[key].target.rpartition(".")
        return t.ndim == 3 and slots[key].is_whole and module in convert and param in ("gate_up_proj", "down_proj")

    renamed: dict[str, list[str]] = {}
    if fmt is QuantFormat.FP8:
        targets = [(k, t) for state, _ in files.values() for k, t in state.items() if fp8_target(k, t)]
        if block is None:
            block = (_largest_block([t.shape[0] for _, t in targets]),
                     _largest_block([t.shape[1] for _, t in targets]))
        for state, _ in files.values():
            for key in [k for k, t in state.items() if fp8_target(k, t)]:
                state[key], state[key + SCALE_SUFFIX] = quantize_fp8(state[key], block)
                renamed[key] = [key, key + SCALE_SUFFIX]
    else:
        for state, _ in files.values():
            for key in [k for k, t in state.items() if mxfp4_target(k, t)]:
                # Stored orientation is [E, out, in]; transformers holds gpt-oss experts as [E, in, out].
                blocks, scales = quantize_mxfp4(state.pop(key).transpose(-1, -2))
                state[key + "_blocks"], state[key + "_scales"] = blocks, scales
                renamed[key] = [key + "_blocks", key + "_scales"]
    spec = QuantSpec(fmt, tuple(block) if fmt is QuantFormat.FP8 else None,
                     None if modules_to_not_convert is None else tuple(modules_to_not_convert))
    if not renamed:
        raise ValueError(f"{type(model).__name__} has no tensor that {fmt.value} quantizes")
    for path, (state, metadata) in files.items():
        save_file(state, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        for old, new in renamed.items():
            shard = wm.pop(old)
            wm.update({k: shard for k in new})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = spec.to_config()
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return spec
