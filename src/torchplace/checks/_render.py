"""Rich tables for explain()'s dict: placement by module, inputs, optimizer state, problems.

A problem's cell holds the first line of its message (what, and the fix); the lines after it (a whole
watch() report, where the model is called) follow the table, so no cell runs long at 120 columns."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..units import format_bytes


def render(data: dict[str, Any]) -> Group:
    model = data["model"]
    parts: list[Any] = []
    table = Table(title=f"where {model['type']} lives ({', '.join(model['devices']) or 'no tensors'})")
    for column in ("module", "type", "device", "parameters", "buffers", "size"):
        table.add_column(column, justify="right" if column in ("parameters", "buffers", "size") else "left")
    for g in data["modules"]:
        name = g["module"] + (" (own tensors)" if g["own"] else "")
        table.add_row(name, g["type"], g["device"], str(g["parameters"]), str(g["buffers"]), format_bytes(g["bytes"]))
    parts.append(table)
    if data["plain_attributes"]:
        parts.append(_rows("plain tensor attributes (not moved by .to())", data["plain_attributes"],
                           ("name", "device", "dtype", "shape")))
    if data["inputs"]:
        parts.append(_rows("inputs", data["inputs"], ("path", "device", "dtype", "shape")))
    opt = data.get("optimizer")
    if opt:
        table = Table(title=f"optimizer {opt['type']} ({opt['parameters']} parameters)")
        table.add_column("state on device")
        table.add_column("tensors", justify="right")
        for device, count in opt["state_devices"].items():
            table.add_row(device, str(count))
        parts.append(table)
    if data["problems"]:
        table = Table(title="problems")
        for column in ("severity", "kind", "where", "what and how to fix"):
            table.add_column(column, overflow="fold")
        details = []
        for p in data["problems"]:
            colour = "red" if p["severity"] == "error" else "yellow"
            first, _, rest = p["message"].partition("\n")
            table.add_row(f"[{colour}]{p['severity']}[/]", p["kind"], Text(p["where"]),
                          Text(first))
            if rest:
                details += [Text(f"{p['kind']} at {p['where']}, in full:", style="bold"),
                            Padding(Text(rest), (0, 0, 0, 2))]
        parts.append(table)
        parts += details
    else:
        parts.append("[green]no placement problems found[/]")
    return Group(*parts)


def _rows(title: str, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    return table
