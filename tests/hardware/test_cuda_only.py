"""Every line of torchplace that names `torch.cuda` outside the CUDA-specific parts says why CUDA alone
needs it, in a `# cuda-only: <reason>` comment on that line (issue 22).

Code that means "the current accelerator" goes through torch.accelerator or the device module
(hardware/accelerator.py: device_module, has_streams, current_index), so it runs on xpu or a
vendor's npu too; tests/backends/ proves it on a second accelerator type. Only code is read
(tokens): `torch.cuda` in a docstring, a message or a comment is prose, not a call.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import torchplace

PACKAGE = Path(torchplace.__file__).parent

# The parts about CUDA itself, with the reason; every other module annotates each line.
CUDA_SPECIFIC = {
    "hardware/visible.py": "the CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER mapping and torch's own parser of it",
    "hardware/topology.py": "NVML facts of NVIDIA GPUs",
    "memory/": "reads CUDA's caching allocator (memory history, snapshots, mem_get_info), which other back ends "
               "do not expose",
    "bench/": "benchmarks measured on CUDA GPUs (H200) against what CUDA users would otherwise write",
}


def _exempt(rel: str) -> bool:
    return any(rel == part or (part.endswith("/") and rel.startswith(part)) for part in CUDA_SPECIFIC)


def cuda_lines(source: str) -> list[tuple[int, str]]:
    """(line number, line) of each line whose code (not strings or comments) names torch.cuda."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    lines = source.splitlines()
    found = []
    for a, b, c in zip(tokens, tokens[1:], tokens[2:]):
        if (a.type, a.string, b.string, c.type, c.string) == (tokenize.NAME, "torch", ".", tokenize.NAME, "cuda"):
            found.append((a.start[0], lines[a.start[0] - 1]))
    return found


def _reasoned(line: str) -> bool:
    _, sep, reason = line.partition("# cuda-only:")
    return bool(sep) and len(reason.strip()) >= 10


def test_the_scanner_reads_code_not_prose():
    source = ('"""torch.cuda in a docstring"""\nx = "torch.cuda"  # torch.cuda in a comment\n'
              'import torch\ny = torch.cuda.is_available()\nz = torch . cuda\n')
    assert [n for n, _ in cuda_lines(source)] == [4, 5]
    assert _reasoned("a = torch.cuda.x  # cuda-only: NVML facts are about NVIDIA GPUs")
    assert not _reasoned("a = torch.cuda.x  # cuda-only:")


def test_every_torch_cuda_outside_the_cuda_parts_says_why():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if _exempt(rel):
            continue
        for lineno, line in cuda_lines(path.read_text()):
            if not _reasoned(line):
                missing.append(f"{rel}:{lineno}: {line.strip()}")
    assert not missing, ("torch.cuda where the code may mean the current accelerator; use torch.accelerator or "
                         "hardware/accelerator.py, or say why CUDA alone needs it with '# cuda-only: <reason>' "
                         "on the line:\n" + "\n".join(missing))


def test_the_cuda_specific_parts_exist():
    for part in CUDA_SPECIFIC:
        assert (PACKAGE / part).exists(), part
