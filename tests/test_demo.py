"""benchmarks/demo.py (`make demo`) echoes each command so that it can be copied and pasted as it is."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "benchmarks" / "demo.py"


@pytest.fixture
def demo():
    spec = importlib.util.spec_from_file_location("demo_under_test", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_echoed_command_pastes_back_to_the_same_arguments(demo, monkeypatch, capsys, tmp_path):
    ran = []
    monkeypatch.setattr(demo, "cli", lambda argv: ran.append(argv) or 0)
    # A folder and a prompt with spaces, quotes and rich-markup brackets, longer than a terminal line.
    argv = ["generate", str(tmp_path / "my models" / "demo [v2]"), "--prompt", "The river's \"mouth\" [bold]at dusk.",
            "--max-new-tokens", "12", "--ignore-eos", "--offload-gb", "0.0175"]
    demo.run(argv)
    assert ran == [argv]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("$ ")        # one line, however long
    assert shlex.split(lines[0][2:]) == [demo.command_name(), *argv]


def test_a_failed_command_is_named_pasteably(demo, monkeypatch, capsys):
    monkeypatch.setattr(demo, "cli", lambda argv: 2)
    with pytest.raises(SystemExit) as exc:
        demo.run(["plan", "a folder"])
    assert f"`{demo.command_name()} plan 'a folder'` failed with status 2" in str(exc.value)
