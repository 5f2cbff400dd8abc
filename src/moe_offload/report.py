"""Human output: rich tables for plans (and, later, loads and benchmarks). GiB appear only here."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .planner import Plan, format_bytes
from .roles import Role


def plan_table(plan: Plan) -> Table:
    table = Table(title=escape(f"{plan.model_type}: {plan.policy} plan"), title_justify="left")
    table.add_column("role")
    table.add_column("params", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("offloaded", justify="right")
    table.add_column("share offloaded", justify="right")
    for role, row in plan.roles().items():
        if row["bytes"] == 0:
            continue
        share = row["offloaded_bytes"] / row["bytes"]
        table.add_row(role, f"{row['params']:,}", format_bytes(row["bytes"]), format_bytes(row["offloaded_bytes"]),
                      f"{share:.0%}")
    table.add_section()
    table.add_row("total", f"{plan.total_params:,}", format_bytes(plan.total_bytes),
                  format_bytes(plan.offloaded_bytes), f"{plan.offloaded_bytes / max(plan.total_bytes, 1):.0%}",
                  style="bold")
    return table


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_table(plan))
    routed = plan.roles()[Role.ROUTED_EXPERT.value]["bytes"]
    console.print(
        f"active params per token: {plan.active_params:,} of {plan.total_params:,}   "
        f"resident: {format_bytes(plan.resident_bytes)}   offloaded: {format_bytes(plan.offloaded_bytes)} "
        f"(budget {format_bytes(plan.budget_bytes)})")
    console.print(
        f"expected link bytes per decoded token at batch {plan.batch}: "
        f"[bold]{format_bytes(plan.link_bytes_per_token())}[/bold]"
        + ("" if routed else "   (dense model: no routed experts)"))
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")  # notes are text, not markup: `[e, h]` must show
