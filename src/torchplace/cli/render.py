"""Rich rendering shared by the CLI commands (tables, findings, bench results)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def bench_table(result: Any) -> None:
    """Print a benchmark result: one row per variant, its value and ratio, then targets."""
    table = Table(title=f"torchplace bench {result.name}")
    table.add_column("variant")
    table.add_column("value", justify="right")
    table.add_column("unit")
    ratio_label = f"vs {result.baseline}" if result.baseline else "ratio"
    table.add_column(ratio_label, justify="right")
    for row in result.rows:
        table.add_row(row.variant, f"{row.value:.4g}", row.unit, "" if row.ratio is None else f"{row.ratio:.2f}x")
    console.print(table)
    for target in result.targets:
        mark = "[green]met[/]" if target.met else "[red]missed[/]"
        console.print(f"target {target.name}: {target.measured:.4g} {target.op} {target.limit:.4g} {mark}")
    for note in result.notes:
        console.print(f"note: {note}")
    machine = result.machine
    console.print(f"[dim]{machine.get('date')} {machine.get('hostname')} torch {machine.get('torch')} "
                  f"{', '.join(machine.get('gpus') or ['no GPU'])}[/]")
