"""The README's Python API example runs as written (on a model made here), so the README stays true."""

import re
from pathlib import Path

import torch
import torch.nn as nn

from moe_offload.tiny import make_tiny

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_example_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    folder = make_tiny(tmp_path / "tiny", family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64)
    code = code.replace('"/tmp/tiny"', repr(str(folder)))

    class Layer(nn.Module):  # what an engine's generator would build
        def __init__(self, cfg):
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.experts = nn.Module()
            self.mlp.experts.down_proj = nn.Parameter(torch.randn(cfg, 4, 4))

    namespace = {"input_ids": torch.tensor([[1, 5, 9]]), "Layer": Layer, "cfg": 8, "n": 2}
    # new_state: an update of every expert weight, in the (transposed) layout the example leaves them in
    exec(compile(code.split("mo.update_weights")[0], "README", "exec"), namespace)
    model = namespace["model"]
    # (full tensors, as a trainer holds them: a tensor split between tiers shows only its host part here)
    splits = model.moe_offload_runtime.splits
    namespace["new_state"] = {n: torch.zeros(p.shape[0] + (splits[n][1] if n in splits else 0), *p.shape[1:])
                              for n, p in model.named_parameters() if "experts" in n}
    rest = "mo.update_weights" + code.split("mo.update_weights", 1)[1]
    exec(compile(rest, "README", "exec"), namespace)
    assert namespace["plan"].tiers["model.layers.0.mlp.experts.down_proj"] == "host"
    assert namespace["off"].offloaded_bytes == 2 * 8 * 4 * 4 * 4  # both layers' down_proj, fp32
    assert namespace["mo"].audit(model, namespace["plan"]) == []
