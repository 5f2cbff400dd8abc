"""Charts of benchmark rows (matplotlib, headless): what a reviewer reads at a glance."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from ..errors import MoeOffloadError
from ..planning.placement import GiB


def _machine(rows: Sequence[dict]) -> str:
    dev = rows[0]["settings"]["device"]
    if dev.startswith("cuda") and torch.cuda.is_available():
        return f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    if dev == "cpu":
        return f"cpu ({os.cpu_count()} cores, torch threads: {rows[0]['settings'].get('threads', '?')})"
    return dev


def plot(rows: Sequence[dict], path, title: str | None = None) -> Path:
    """Two panels: tok/s (1/ITL) and measured link bytes per token, per arm, grouped by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise MoeOffloadError("nothing to plot: no arm ran")
    path = Path(path)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["arm"], r["concurrency"]): r for r in rows}
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(arms)}
    width = 0.8 / len(arms)

    links = [r["link_bytes_per_token"] for r in rows]
    scale, unit = next(((s, u) for s, u in ((GiB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")) if max(links) >= s),
                       (1, "bytes"))
    positive = [x for x in links if x > 0]
    log_scale = bool(positive) and max(positive) / min(positive) > 30

    fig, (ax_tok, ax_link) = plt.subplots(1, 2, figsize=(12, 4.8))
    for panel, key, ylabel in ((ax_tok, "tok_s_itl", "tokens / s, all sequences (1 / ITL p50)"),
                               (ax_link, "link_bytes_per_token", f"measured link {unit} per decoded token")):
        for i, arm in enumerate(arms):
            xs, ys = [], []
            for j, c in enumerate(levels):
                if (arm, c) in by:
                    xs.append(j + (i - (len(arms) - 1) / 2) * width)
                    ys.append(by[(arm, c)][key] / (scale if panel is ax_link else 1))
            bars = panel.bar(xs, ys, width * 0.95, label=arm, color=colours[arm])
            fmt = "{:.1f}" if panel is ax_tok else "{:.3g}"
            panel.bar_label(bars, labels=[fmt.format(y) if y > 0 else "0" for y in ys], fontsize=8, padding=2)
        panel.set_xticks(range(len(levels)), [f"{c} concurrent" for c in levels])
        panel.set_xlabel("sequences decoded together")
        panel.set_ylabel(ylabel)
        panel.grid(axis="y", alpha=0.3)
        panel.margins(y=0.15)
    if log_scale:
        ax_link.set_yscale("log")
    on_cpu = all(r["settings"]["device"] == "cpu" for r in rows)
    ax_tok.set_title("decode speed (higher is better)" + ("\ncpu: machinery overhead, no real link" if on_cpu else ""))
    ax_link.set_title("host-link traffic per token (lower is better)" + (", log scale" if log_scale else ""))
    ax_tok.legend(title="arm", fontsize=8)
    first = rows[0]
    title = title or (f"{first['model']} ({first['model_type']}), budget: {first['budget']}, "
                      f"backend {first['settings']['backend']}")
    sub = (f"{_machine(rows)}; {first['runs']} measured runs after 1 warm-up; "
           f"{first['max_new_tokens']} new tokens per sequence")
    if first["same_prompt"]:
        sub += "; same prompt for every sequence"
    fig.suptitle(f"{title}\n{sub}", fontsize=11)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MoeOffloadError(f"cannot write {path}: {exc.strerror}; choose a writable path") from exc
    finally:
        plt.close(fig)
    return path
