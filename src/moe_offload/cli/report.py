"""Human output: rich tables for plans and benchmark rows. GiB appear only here and in plots."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..planning.placement import Plan, format_bytes
from ..model.roles import Role


def plan_table(plan: Plan) -> Table:
    table = Table(title=escape(f"{plan.model_type}: {plan.policy} plan"), title_justify="left")
    table.add_column("role")
    table.add_column("params", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("host", justify="right")
    table.add_column("disk", justify="right")
    table.add_column("share offloaded", justify="right")
    disk = {}
    for t in plan.tensors:
        disk[t.role] = disk.get(t.role, 0) + t.disk_bytes
    for role, row in plan.roles().items():
        if row["bytes"] == 0:
            continue
        share = row["offloaded_bytes"] / row["bytes"]
        table.add_row(role, f"{row['params']:,}", format_bytes(row["bytes"]),
                      format_bytes(row["offloaded_bytes"] - disk.get(role, 0)), format_bytes(disk.get(role, 0)),
                      f"{share:.0%}")
    table.add_section()
    table.add_row("total", f"{plan.total_params:,}", format_bytes(plan.total_bytes), format_bytes(plan.host_bytes),
                  format_bytes(plan.disk_bytes), f"{plan.offloaded_bytes / max(plan.total_bytes, 1):.0%}",
                  style="bold")
    return table


def tensors_table(plan: Plan) -> Table:
    """Every tensor with its role, size, access density at the plan's batch and tier, in declaration order."""
    table = Table(title=f"{len(plan.tensors)} tensors, declaration order", title_justify="left")
    for header in ("name", "role", "shape", "dtype", "bytes", "density", "tier"):
        table.add_column(header, justify="right" if header in ("bytes", "density") else "left",
                         no_wrap=header == "name")
    for t in plan.tensors:
        style = "cyan" if t.tier != "device" else None
        table.add_row(escape(t.name), t.role, "x".join(map(str, t.shape)), t.dtype, format_bytes(t.bytes),
                      f"{t.density(plan.batch):.4g}",
                      _tier_cell(t),
                      style=style)
    return table


def _tier_cell(t) -> str:
    if t.tier == "disk" and t.memory_ids:   # offloaded experts in two tiers
        return f"disk ({len(t.disk_ids)} of {t.shape[0]} experts; {len(t.memory_ids)} on the host)"
    if (t.host_expert_ids or t.host_experts) and t.shape[0] in (len(t.host_expert_ids), t.host_experts):
        return t.tier   # every expert off the device: the tensor lies whole in its tier
    if t.host_expert_ids and t.host_expert_ids != tuple(range(t.shape[0] - t.host_experts, t.shape[0])):
        # any subset of the experts (frequency placement); the last ones are said so below
        ids = f": {','.join(map(str, t.host_expert_ids))}" if len(t.host_expert_ids) <= 8 else ""   # the JSON has all
        return f"{t.tier} ({t.host_experts} of {t.shape[0]} experts{ids})"
    if t.host_experts:
        return f"{t.tier} (last {t.host_experts} of {t.shape[0]} experts)"
    return t.tier


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_table(plan))
    routed = plan.roles()[Role.ROUTED_EXPERT.value]["bytes"]
    console.print(
        f"active params per token: {plan.active_params:,} of {plan.total_params:,}   "
        f"resident: {format_bytes(plan.resident_bytes)}   offloaded: {format_bytes(plan.offloaded_bytes)} "
        f"(budget {format_bytes(plan.budget_bytes)})"
        + (f"   host: {format_bytes(plan.host_bytes)}   disk: {format_bytes(plan.disk_bytes)}"
           if plan.host_budget_bytes is not None else ""))
    host_link, disk_read = plan.link_bytes_by_tier()
    console.print(
        f"expected link bytes per decoded token at batch {plan.batch}: "
        f"[bold]{format_bytes(host_link + disk_read)}[/bold]"
        + (f" ({format_bytes(host_link)} from host memory, {format_bytes(disk_read)} from disk)"
           if plan.host_budget_bytes is not None else "")
        + ("" if routed else "   (dense model: no routed experts)"))
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")  # notes are text, not markup: `[e, h]` must show


# --- benchmark rows ----------------------------------------------------------------------------

_SPEED = (("ITL p50 ms", lambda r: f"{r['itl_p50_ms']:.2f}"), ("ITL p90 ms", lambda r: f"{r['itl_p90_ms']:.2f}"),
          ("tok/s 1/ITL", lambda r: f"{r['tok_s_itl']:.1f}"), ("tok/s wall", lambda r: f"{r['tok_s_wall']:.1f}"),
          ("TTFT ms", lambda r: f"{r['ttft_ms']:.1f}"), ("spread", lambda r: f"{r['spread_pct']:.0f}%"))
_BYTES = (("offloaded", lambda r: format_bytes(r["offloaded_bytes"])),
          ("link/token", lambda r: format_bytes(r["link_bytes_per_token"])),
          ("link ms/token", lambda r: f"{r['link_ms_per_token']:.3f}" if "link_ms_per_token" in r else ""),
          ("host", lambda r: format_bytes(r["host_bytes"])), ("device", lambda r: format_bytes(r["device_bytes"])))


def _table(rows: Sequence[dict], columns, title: str | None = None, caption: str | None = None):
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column("arm", no_wrap=True)
    table.add_column("conc", justify="right")
    for header, _ in columns:
        table.add_column(header, justify="right", no_wrap=header in ("offloaded", "link/token", "host", "device"))
    previous = None
    for r in rows:
        if previous is not None and r["arm"] != previous:
            table.add_section()
        previous = r["arm"]
        table.add_row(r["arm"], str(r["concurrency"]), *(cell(r) for _, cell in columns))
    return table


def print_table(rows: Sequence[dict], console=None) -> None:
    """One table on a wide console; on a narrow one, speed and bytes as two tables."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # a file or pipe: no terminal width to respect, keep rows on one line
    if not rows:
        console.print("no arm ran (see the reasons above)")
        return
    first = rows[0]
    prompts = ("the SAME prompt for every sequence (--same-prompt): batched sequences route alike, so link "
               "figures are lower than real traffic" if first["same_prompt"] else "a distinct prompt per sequence")
    title = (f"{first['model']}: {first['budget']}, {first['settings']['backend']} on {first['settings']['device']}; "
             f"{first['runs']} measured runs after 1 warm-up, {first['max_new_tokens']} new tokens each")
    byte_cols = [c for c in _BYTES if c[0] != "link ms/token" or any("link_ms_per_token" in r for r in rows)]
    if console.width >= 150:
        console.print(_table(rows, [*_SPEED, *byte_cols], title, f"prompts: {prompts}"))
    else:
        console.print(_table(rows, _SPEED, title))
        # host bytes (the arena, alignment included) is in the JSON; offloaded says the same to a few bytes
        console.print(_table(rows, [c for c in byte_cols if c[0] != "host"], caption=f"prompts: {prompts}"))
    for mech in dict.fromkeys(r["mechanism"] for r in rows):
        console.print(f"mechanism: {mech}", highlight=False)
    if all(r["settings"]["device"] == "cpu" for r in rows):
        from ..measure.bench import CPU_NOTE

        console.print(f"[yellow]note:[/yellow] {CPU_NOTE}", highlight=False)
