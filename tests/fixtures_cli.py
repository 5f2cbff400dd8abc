"""The command line as a process runs it, and the config.json-alone model several CLI tests share.

Imported explicitly (not a conftest). QWEN3_CONFIG is a Qwen3-MoE float32 config (hidden 32, 2 layers, E=4,
top-k 2, vocab 128):

    model.embed_tokens.weight         (128, 32)   16384 B   (one row: 128 B)
    per layer mlp.experts.gate_up_proj (4, 32, 32)  16384 B = 4 x 4096 B
              mlp.experts.down_proj    (4, 32, 16)   8192 B = 4 x 2048 B   (one expert: 6144 B)
    whole model 108288 B
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_offload.cli.main import main

QWEN3_CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "tie_word_embeddings": False,
    "dtype": "float32",
}
QWEN3_TOTAL = 108288
QWEN3_EXPERT = 6144


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """main() as a process would run it: (exit status, stdout, stderr)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:   # argparse usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys, *argv) -> dict:
    """Run the CLI, which must succeed, and return the one JSON document it printed."""
    import json

    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    return json.loads(out)


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory nothing can be created in: a read-only folder, or /sys for root (whom mode bits do not stop)."""
    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    return folder


# decode picks of layers 0 and 1 of QWEN3_CONFIG's model for the replay CLI tests; expert 0 of layer 0 is the
# favourite (5 of 6 tokens), expert 3 never picked
REPLAY_ROWS = [((0, 1), (0, 2)), ((0, 2), (1, 2)), ((0, 1), (2, 0)), ((1, 2), (0, 1)), ((0, 2), (2, 1)),
               ((0, 1), (0, 2))]


def write_replay_files(folder: Path) -> Path:
    """QWEN3_CONFIG's config.json and a trace of one prefill row and REPLAY_ROWS' decode rows, in `folder`."""
    import json

    from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace

    (folder / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    rows = [TraceRow(0, 0, "prefill", ((0, 1), (0, 1)))]
    rows += [TraceRow(0, 1 + i, "decode", r) for i, r in enumerate(REPLAY_ROWS)]
    write_trace(folder / "trace.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"), rows)
    return folder
