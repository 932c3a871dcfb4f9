"""Rich rendering shared by the CLI commands (tables, findings, bench results)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..units import format_bytes

console = Console()


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


def _gpu_table(facts: Any, title: str) -> Table:
    vis = facts.visible
    table = Table(title=title)
    for col in ("physical", "cuda", "name", "uuid", "bus id", "memory used / total", "util", "processes"):
        table.add_column(col, justify="right" if col in ("physical", "util") else "left")
    for gpu in facts.topology.gpus:
        logical = vis.logical_of(gpu.physical_index)
        procs = "?" if gpu.processes is None else str(len(gpu.processes))
        if gpu.processes:
            procs += " (" + ", ".join(f"{p.pid}{'/' + p.user if p.user else ''}" for p in gpu.processes[:3]) + ")"
        table.add_row(str(gpu.physical_index), f"cuda:{logical}" if logical is not None else "[dim]hidden[/]",
                      gpu.name or "?", gpu.uuid, gpu.pci_bus_id or "?",
                      f"{format_bytes(gpu.memory_used_bytes, 'GiB')} / {format_bytes(gpu.memory_total_bytes, 'GiB')}",
                      "?" if gpu.utilization is None else f"{gpu.utilization}%", procs)
    return table


def _env_line(facts: Any) -> str:
    vis = facts.visible
    cvd = "unset" if vis.cuda_visible_devices is None else repr(vis.cuda_visible_devices)
    order = vis.cuda_device_order or "unset"
    return f"CUDA_VISIBLE_DEVICES={cvd}  CUDA_DEVICE_ORDER={order} (enumeration: {vis.order})"


def render_map(facts: Any, notes: list[str]) -> None:
    console.print(_env_line(facts))
    if facts.topology.gpus:
        console.print(_gpu_table(facts, "physical <-> logical"))
    elif not notes:
        console.print("No GPU found.")
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")


def _links_table(facts: Any) -> Table | None:
    topo = facts.topology
    if len(topo.gpus) < 2:
        return None
    table = Table(title="interconnect (NV# = NVLink count; PIX/PXB/PHB/NODE/SYS = PCIe path)")
    table.add_column("")
    for gpu in topo.gpus:
        table.add_column(f"GPU{gpu.physical_index}")
    for a in topo.gpus:
        cells = []
        for b in topo.gpus:
            link = topo.link(a.physical_index, b.physical_index)
            cells.append("X" if a.physical_index == b.physical_index else (link.label() if link else "?"))
        table.add_row(f"GPU{a.physical_index}", *cells)
    return table


def render_report(report: Any) -> None:
    facts = report.facts
    v, topo, host = facts.versions, facts.topology, facts.host
    console.print(f"[bold]torchplace doctor[/] ({'this machine' if facts.source == 'live' else facts.source})")
    console.print(f"python {v.python}  torch {v.torch or 'not installed'}  built with CUDA {v.torch_cuda or 'none'}"
                  f"  cuDNN {v.cudnn or '?'}  NCCL {v.nccl or '?'}")
    console.print(f"driver {topo.driver_version or 'none'}  (CUDA {topo.cuda_driver_version or '?'})  "
                  f"CPUs usable {host.usable_cpus} of {host.cpu_count}  "
                  f"memory {format_bytes(host.memory_total_bytes, 'GiB')}  "
                  f"/dev/shm {format_bytes(host.shm_total_bytes, 'GiB')}")
    console.print(_env_line(facts))
    if topo.gpus:
        console.print(_gpu_table(facts, "GPUs"))
        links = _links_table(facts)
        if links is not None:
            console.print(links)
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    if not report.findings:
        console.print("[green]No problems found.[/]")
    for f in report.findings:
        console.print(f"[{colors[f.severity]}]{f.severity.upper()}[/] {f.title}\n    {f.detail}")
        if f.fix:
            console.print(f"    [bold]fix:[/] {f.fix}")
    console.print(f"[dim]{report.elapsed_s * 1000:.0f} ms; CUDA was not initialized.[/]")
