"""benchmarks/prefetch_bench.py end to end at an eighth of its sizes: every read shape at every thread count, this
CPU's default among them and named, written where --out says and nowhere else."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from moe_offload.kernels import prefetch_distances

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "prefetch_bench.py"


def test_quick_run_measures_every_distance_and_names_the_default(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("prefetch_bench_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--threads", "1", "2", "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["prefetch_bench.json"]
    result = json.loads((tmp_path / "prefetch_bench.json").read_text())
    default = prefetch_distances()
    assert result["default"] == f"{default.l1} / {default.l2}" + (f", {default.rows} rows" if default.rows > 1 else "")
    names = [bench.label(p) for p in bench.DISTANCES]
    assert result["default"] in names
    assert [(r["threads"], r["distances"]) for r in result["rows"]] == [(t, n) for t in (1, 2) for n in names]
    assert all(r["lm_head_gbs"] > 0 and r["experts_gbs"] > 0 for r in result["rows"])
    assert f"{result['default']} (default)" in capsys.readouterr().out
