"""Rich rendering shared by the CLI commands (tables, findings, bench results).

Two rules hold for everything printed here (issue 18):
- Markup is off. Notes, GPU names, commands and paths can hold brackets (`pip install
  'torchplace[bench]'`), so text is never parsed for `[style]` tags; colour is given with
  `Text.assemble` and `style=` instead.
- Ids are never cut. On a terminal a table wraps its other columns first, each cell to at most
  two lines, and when even that cannot keep every id whole, prints its rows as plain
  `header value` lines that wrap between fields. Into a pipe or a file nothing wraps: the width
  is unlimited, so `torchplace map | cat` and `torchplace doctor > report.txt` keep each UUID
  and each value on one line whatever COLUMNS says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ..units import format_bytes
from .options import has_controls, visible

#: The width of output that goes to a pipe or a file: no line is ever wrapped there.
PIPE_WIDTH = 100_000


class _Console(Console):
    """A rich Console that prints control characters of the text it is given as visible escapes
    (`visible`): GPU names, tensor keys and hostnames come from snapshots and checkpoints made
    elsewhere, and an ESC in one would otherwise drive the terminal (retitle it, clear it, hide text).
    rich's own styling is added after this, so colours still work."""

    def on_broken_pipe(self) -> None:
        """The reader closed the pipe (`torchplace doctor | head -1`): end as main() ends it (exit 0), not
        with rich's own exit 1."""
        self.quiet = True
        raise BrokenPipeError

    def render(self, renderable: Any, options: Any = None) -> Iterator[Segment]:
        for segment in super().render(renderable, options):
            if segment.control is None and has_controls(segment.text):
                segment = Segment(visible(segment.text), segment.style, segment.control)
            yield segment


def make_console(*, stderr: bool = False) -> Console:
    """A console with markup, emoji codes and highlighting off; unlimited width unless a terminal."""
    settings: dict[str, Any] = {"stderr": stderr, "markup": False, "emoji": False, "highlight": False}
    probe = _Console(**settings)
    if probe.is_terminal:
        return probe
    return _Console(width=PIPE_WIDTH, soft_wrap=True, **settings)


console = make_console()


def line(*parts: str | tuple[str, str]) -> Text:
    """One line from plain strings and (text, style) pairs; nothing in it is read as markup."""
    return Text.assemble(*parts)


#: A table is printed only where no cell needs more lines than this; a row of fragments reads worse than fields.
MAX_CELL_LINES = 2


def show_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str | Text]], *,
               ids: Sequence[str] = (), right: Sequence[str] = (), out: Console | None = None) -> None:
    """Print a table whose id columns (IDS, by header) are never cut or wrapped.

    The layout is chosen by what fits: a table where each other cell wraps to at most MAX_CELL_LINES
    lines between words; else each row as `header value` fields packed into lines, a field never split."""
    out = out or console
    cells = [[str(header), *(str(row[i]) for row in rows)] for i, header in enumerate(headers)]
    natural = [max(cell_len(text) for text in column) for column in cells]
    least = [width if header in ids else _narrowest(column, width, out)
             for header, width, column in zip(headers, natural, cells)]
    room = out.width - (3 * len(headers) + 1)  # a border before each column and after the last, padding 1+1
    if sum(least) > room:
        _rows_as_fields(title, headers, rows, out)
        return
    fits = sum(natural) <= room
    widths = list(natural)
    while sum(widths) > room:  # narrow the column with the most room to give, one cell at a time
        i = max(range(len(widths)), key=lambda k: widths[k] - least[k])
        widths[i] -= 1
    table = Table(title=title)
    for header, width in zip(headers, widths):
        table.add_column(header, justify="right" if header in right else "left", no_wrap=header in ids,
                         overflow="fold", width=None if fits else width)
    for row in rows:
        table.add_row(*row)
    out.print(table)


def _narrowest(column: list[str], natural: int, out: Console) -> int:
    """The narrowest width at which every text of COLUMN wraps, between words, to at most MAX_CELL_LINES lines."""
    longest_word = max((cell_len(w) for text in column for w in text.split()), default=1)
    for width in range(longest_word, natural):
        if all(len(Text(text).wrap(out, width)) <= MAX_CELL_LINES for text in column):
            return width
    return natural


def _rows_as_fields(title: str, headers: Sequence[str], rows: Sequence[Sequence[str | Text]], out: Console) -> None:
    """Each row as `header value` fields, packed into lines no wider than the terminal."""
    out.print(title, style="bold")
    for row in rows:
        lines: list[Text] = []
        current = Text("  ")
        for header, cell in zip(headers, row):
            if not str(cell):
                continue
            field = Text.assemble((str(header), "dim"), " ", cell) if header else Text.assemble(cell)
            if current.cell_len > 2 and current.cell_len + 3 + field.cell_len > out.width:
                lines.append(current)
                current = Text("    ")
            elif current.cell_len > 4 or (current.cell_len > 2 and not lines):
                current.append("   ")
            current.append_text(field)
        lines.append(current)
        for text in lines:
            out.print(text, overflow="ignore", crop=False, no_wrap=True)


def bench_table(result: Any) -> None:
    """Print a benchmark result: one row per variant, its value and ratio, then targets."""
    ratio_label = f"vs {result.baseline}" if result.baseline else "ratio"
    rows = [[row.variant, f"{row.value:.4g}" + (f" [{row.extra['q1']:.3g}..{row.extra['q3']:.3g}]" if "q1" in row.extra
                                              else ""), row.unit, "" if row.ratio is None else f"{row.ratio:.2f}x"]
            for row in result.rows]
    show_table(f"torchplace bench {result.name}", ["variant", "value", "unit", ratio_label], rows,
               ids=["variant"], right=["value", ratio_label])
    for target in result.targets:
        mark = (f"not judged: {target.not_here}", "yellow") if target.not_here else \
            ("met", "green") if target.met else ("missed", "red")
        console.print(line(f"target {target.name}: {target.describe()} ", mark))
    for note in result.notes:
        console.print(line(("note:", "yellow"), f" {note}"))
    machine = result.machine
    console.print(f"{machine.get('date')} {machine.get('hostname')} torch {machine.get('torch')} "
                  f"{', '.join(machine.get('gpus') or ['no GPU'])}", style="dim")


def _gpu_rows(facts: Any) -> list[list[str | Text]]:
    vis = facts.visible
    rows: list[list[str | Text]] = []
    for gpu in facts.topology.gpus:
        logical = vis.logical_of(gpu.physical_index)
        procs = "?" if gpu.processes is None else str(len(gpu.processes))
        if gpu.processes:
            procs += " (" + ", ".join(f"{p.pid}{'/' + p.user if p.user else ''}" for p in gpu.processes[:3]) + ")"
        rows.append([str(gpu.physical_index), f"cuda:{logical}" if logical is not None else Text("hidden", "dim"),
                     gpu.name or "?", gpu.uuid, gpu.pci_bus_id or "?",
                     f"{format_bytes(gpu.memory_used_bytes, 'GiB')} / {format_bytes(gpu.memory_total_bytes, 'GiB')}",
                     "?" if gpu.utilization is None else f"{gpu.utilization}%", procs])
    return rows


_GPU_HEADERS = ["physical", "cuda", "name", "uuid", "bus id", "memory used / total", "util", "processes"]


def _gpu_table(facts: Any, title: str) -> None:
    show_table(title, _GPU_HEADERS, _gpu_rows(facts), ids=["uuid", "bus id", "cuda"], right=["physical", "util"])


def _env_line(facts: Any) -> str:
    vis = facts.visible
    cvd = "unset" if vis.cuda_visible_devices is None else repr(vis.cuda_visible_devices)
    order = vis.cuda_device_order or "unset"
    return f"CUDA_VISIBLE_DEVICES={cvd}  CUDA_DEVICE_ORDER={order} (enumeration: {vis.order})"


def render_map(facts: Any, notes: list[str]) -> None:
    console.print(_env_line(facts))
    if facts.topology.gpus:
        _gpu_table(facts, "physical <-> logical")
    elif not notes:
        console.print("No GPU found.")
    for note in notes:
        console.print(line(("note:", "yellow"), f" {note}"))


MAX_LINKS_DRAWN = 32  # GPUs in the interconnect matrix: a wider one is unreadable (and --json has it)


def _links_table(facts: Any) -> None:
    topo = facts.topology
    if len(topo.gpus) < 2:
        return
    if len(topo.gpus) > MAX_LINKS_DRAWN:
        console.print(f"interconnect: {len(topo.gpus)} GPUs, too many to draw as a matrix (at most "
                      f"{MAX_LINKS_DRAWN}); `torchplace doctor --json` lists every link.", style="dim")
        return
    headers = [""] + [f"GPU{gpu.physical_index}" for gpu in topo.gpus]
    rows = []
    for a in topo.gpus:
        cells = []
        for b in topo.gpus:
            link = topo.link(a.physical_index, b.physical_index)
            cells.append("X" if a.physical_index == b.physical_index else (link.label() if link else "?"))
        rows.append([f"GPU{a.physical_index}", *cells])
    show_table("interconnect", headers, rows, ids=headers)
    console.print("NV# = NVLink count; PIX/PXB/PHB/NODE/SYS = PCIe path", style="dim")


def _known(*pairs: tuple[str, Any]) -> tuple[str, list[str]]:
    """'name value' for each known value, two spaces apart, and the names whose value is unknown."""
    shown = [f"{name} {value}" for name, value in pairs if value is not None]
    return "  ".join(shown), [name for name, value in pairs if value is None]


def _machine_lines(facts: Any) -> list[str]:
    """The versions and host lines; a snapshot's unrecorded fields are named once, not printed as None."""
    v, topo, host = facts.versions, facts.topology, facts.host
    live = facts.source == "live"
    cpus = None
    if host.cpu_count is not None:
        cpus = f"{host.usable_cpus} of {host.cpu_count}"

    def bytes_or_none(n: int | None) -> str | None:
        return None if n is None else format_bytes(n, "GiB")

    # a CPU build of torch has no cuDNN or NCCL: absent, not unknown
    cuda_libs = [("cuDNN", v.cudnn), ("NCCL", v.nccl)] if v.torch_cuda or not v.torch else []
    first, missing = _known(("python", v.python), ("torch", v.torch or ("not installed" if live else None)),
                            ("built with CUDA", v.torch_cuda or ("none" if v.torch else None)), *cuda_libs)
    cuda = f"{topo.driver_version}  (CUDA {topo.cuda_driver_version or '?'})" if topo.driver_version else \
        ("none" if live else None)
    second, missing2 = _known(("driver", cuda), ("CPUs usable", cpus),
                              ("memory", bytes_or_none(host.memory_total_bytes)),
                              ("/dev/shm", bytes_or_none(host.shm_total_bytes)))
    lines = [text for text in (first, second) if text]
    unknown = missing + missing2
    if unknown:
        where = "the snapshot does not record" if not live else "unknown"
        lines.append(f"{where}: {', '.join(unknown)}")
    return lines


def _print_fields(text: str, out: Console | None = None) -> None:
    """A line of `name value` fields two spaces apart, wrapped between fields, never inside one
    (`NCCL` at the end of a line and `2.28.9` on the next reads as two facts)."""
    out = out or console
    current = ""
    for field in text.split("  "):
        if current and cell_len(current) + 2 + cell_len(field) > out.width:
            out.print(current)  # a field longer than the line alone still wraps, between words
            current = "  " + field
        else:
            current = f"{current}  {field}" if current else field
    out.print(current)


def render_report(report: Any) -> None:
    facts = report.facts
    topo = facts.topology
    console.print(line(("torchplace doctor", "bold"),
                       f" ({'this machine' if facts.source == 'live' else facts.source})"))
    for text in _machine_lines(facts):
        _print_fields(text)
    console.print(_env_line(facts))
    if topo.gpus:
        _gpu_table(facts, "GPUs")
        _links_table(facts)
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    if not report.findings:
        console.print("No problems found.", style="green")
    for f in report.findings:
        console.print(line((f.severity.upper(), colors[f.severity]), f" {f.title}"))
        console.print(f"    {f.detail}")
        if f.fix:
            console.print(line("    ", ("fix:", "bold"), f" {f.fix}"))
    console.print(f"{report.elapsed_s * 1000:.0f} ms; CUDA was not initialized.", style="dim")
