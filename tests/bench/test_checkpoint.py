"""`torchplace bench checkpoint --quick`: every variant runs on a CPU, targets are recorded, files are removed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from torchplace.bench import checkpoint as bench
from torchplace.errors import TorchplaceError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_quick_run_measures_every_variant_and_cleans_up(tmp_path: Path) -> None:
    args = _args("--quick", "--sizes", "4MiB,2MiB", "--layouts", "gpt2", "--dir", str(tmp_path), "--device", "cpu")
    result = bench.run(args)
    variants = [row.variant for row in result.rows]
    assert variants == ["4MiB plain write+fsync", "4MiB torch.save+fsync", "4MiB torchplace.save",
                        "4MiB torch.load -> cpu", "4MiB torchplace.load -> cpu",
                        "4MiB stall: bare copy into pinned host memory", "4MiB stall: torch.save+fsync",
                        "4MiB stall: dcp.async_save", "4MiB stall: torchplace.save_async",
                        "4MiB stall: torchplace.save_async, first save", "4MiB step alone",
                        "4MiB step while save_async writes", "4MiB load -> cpu: safetensors load_file",
                        "4MiB load -> cpu: torch.load(mmap)+.to", "4MiB load -> cpu: torchplace.load",
                        "4MiB cold: raw O_DIRECT read of the file", "4MiB cold: torchplace.load -> cpu",
                        # later sizes and the layouts: loads and the save_async stall only
                        "gpt2 stall: bare copy into pinned host memory", "gpt2 stall: torchplace.save_async",
                        "gpt2 stall: torchplace.save_async, first save",
                        "gpt2 load -> cpu: safetensors load_file", "gpt2 load -> cpu: torch.load(mmap)+.to",
                        "gpt2 load -> cpu: torchplace.load",
                        "2MiB stall: bare copy into pinned host memory", "2MiB stall: torchplace.save_async",
                        "2MiB stall: torchplace.save_async, first save",
                        "2MiB load -> cpu: safetensors load_file", "2MiB load -> cpu: torch.load(mmap)+.to",
                        "2MiB load -> cpu: torchplace.load"]
    assert all(row.value > 0 and row.unit in ("GB/s", "ms") and row.ratio is not None for row in result.rows)
    # every warm figure ran two interleaved rounds (--quick), and its spread is recorded
    warm = [row for row in result.rows if " cold: " not in row.variant and "step " not in row.variant
            and "first save" not in row.variant]
    assert all(row.extra["n"] == 2 and row.extra["q1"] <= row.value <= row.extra["q3"] for row in warm)
    # save_async's stall: the first save (which allocated the staging buffers) apart from the rounds after it,
    # which took the repeated path; the flags are in the JSON and the notes say how many
    rows = {row.variant: row for row in result.rows}
    for label, nbytes in (("4MiB", 4 * 2**20), ("gpt2", result.params["cases"]["gpt2"]["bytes"]), ("2MiB", 2**21)):
        first = rows[f"{label} stall: torchplace.save_async, first save"].extra
        assert first["n"] == 1 and first["repeated"] == [False] and first["allocated_bytes"] >= nbytes, label
        assert rows[f"{label} stall: torchplace.save_async"].extra["repeated"] == [True, True], label
        assert any(note.startswith(f"{label}: save_async stall") and "2 of the 2 saves after it took the repeated"
                   in note for note in result.notes), label
    assert rows["4MiB step while save_async writes"].extra["repeated"] == [True]
    assert [t.name for t in result.targets] == ["4MiB save vs plain write", "4MiB save_async stall vs bare pinned copy",
                                                "4MiB save_async stall vs dcp.async_save stall",
                                                "4MiB step while writing vs alone",
                                                "gpt2 save_async stall vs bare pinned copy",
                                                "2MiB save_async stall vs bare pinned copy"]
    assert all(t.spread is not None for t in result.targets)
    assert result.params["cases"]["gpt2"]["tensors"] == 148 and result.params["cases"]["gpt2"]["repeats"] == 2
    assert any(note.startswith("ran: 4MiB") for note in result.notes)
    # peers that cannot run here are named once, with the cases they would have run for
    assert any("instanttensor left out: it loads to GPUs only" in note and note.startswith("4MiB, gpt2, 2MiB")
               for note in result.notes)
    assert list(tmp_path.iterdir()) == []
    # --quick on a CPU printed each target as missed or met: none is judged on a smoke test
    assert all(t.not_here and "--quick" in t.not_here for t in result.targets)
    assert all(t["met"] is None for t in result.to_dict()["targets"])


def test_a_budget_skips_the_cases_it_cannot_fit(tmp_path: Path) -> None:
    args = _args("--quick", "--sizes", "1MiB,64MiB", "--dir", str(tmp_path), "--device", "cpu",
                 "--layouts", "gpt2", "--budget-s", "0")
    result = bench.run(args)  # the first case of each kind runs (nothing to scale from); the 64 MiB one cannot fit
    labels = {row.variant.split()[0] for row in result.rows}
    assert labels == {"1MiB", "gpt2"}
    assert any(note.startswith("64MiB: skipped: about") and "--budget-s 0" in note for note in result.notes)


def test_targets_set_for_a_gpu_are_not_judged_on_a_cpu() -> None:
    import torch

    from torchplace.bench import checkpoint_async

    stalls = {"copy": [1.0, 1.1], "tsave": [2.0, 2.0], "dcp": [4.0, 4.1], "async": [0.5, 0.6]}
    loads = {"st": [1.0, 1.0], "mmap": [1.0, 1.0], "tp": [0.1, 0.1], "it": [0.2, 0.2], "direct_cold": [1.0, 1.0],
             "tp_cold": [1.0, 1.0]}
    for dev, judged in ((torch.device("cpu"), ["4MiB save_async stall vs dcp.async_save stall"]),
                        (torch.device("cuda", 0), None)):
        _, stall_targets = checkpoint_async.stall_rows("4MiB", dev, stalls, {}, full=True)
        _, load_targets = checkpoint_async.load_rows("4MiB", 4 * 2**20, dev, loads, {}, layout=False)
        targets = stall_targets + load_targets
        names = [t.name for t in targets if t.not_here is None]
        assert names == judged if judged else len(names) == len(targets) == 5


def test_load_targets_by_case() -> None:
    import torch

    from torchplace.bench import checkpoint_async

    dev = torch.device("cuda", 0)
    loads = {"st": [1.0], "mmap": [1.0], "tp": [0.1], "it": [0.2]}
    for size, layout, floor in ((10 * 2**30, False, 40.0), (2**30, False, 35.0), (2**30, True, 30.0)):
        _, targets = checkpoint_async.load_rows("x", size, dev, loads, {}, layout=layout)
        assert [(t.limit, t.op) for t in targets] == [(floor, ">="), (1.15, ">=")]
        assert targets[1].measured == pytest.approx(2.0) and targets[1].met


def test_layouts_are_shaped_like_the_models() -> None:
    llama, gpt2 = bench.llama_shapes(), bench.gpt2_shapes()
    assert len(llama) == 291 and llama["model.layers.31.mlp.down_proj.weight"] == (2048, 5632)
    assert len(gpt2) == 148
    params = sum(a * (b[0] if b else 1) for a, *b in gpt2.values())
    assert 123e6 < params < 125e6  # GPT-2 "124M", its head tied to the embedding
    assert bench.Case("c", bench.size_shapes(3 * 2**20 + 6)).nbytes == 3 * 2**20 + 6


def test_sizes_and_layouts_parse() -> None:
    assert bench.parse_sizes("1GiB,512MiB,2") == [2**30, 2**29, 2 * 2**30]
    assert bench.parse_sizes("none") == []
    with pytest.raises(ValueError, match="not understood"):
        bench.parse_sizes("lots")
    cases = bench.cases_for(_args("--sizes", "1GiB,2GiB", "--layouts", "llama7b"))
    assert [(c.label, c.full, c.cold) for c in cases] == [("1GiB", True, True), ("2GiB", False, False),
                                                           ("llama7b", False, False)]
    # the full set first, then the rest by size: a --budget-s run skips the largest, last
    assert [c.label for c in bench.cases_for(_args("--sizes", "1GiB,10GiB"))] == ["1GiB", "gpt2", "llama", "10GiB"]
    assert all(c.full and c.cold for c in bench.cases_for(_args("--full", "--sizes", "1,2")))
    with pytest.raises(TorchplaceError, match="unknown.*choose from llama, llama7b, gpt2"):
        bench.cases_for(_args("--layouts", "bert"))
    with pytest.raises(TorchplaceError, match="nothing to measure"):
        bench.cases_for(_args("--sizes", "none", "--layouts", "none"))


def test_slow_peers_and_rounds_are_spent_where_they_inform() -> None:
    cases = {c.label: c for c in bench.cases_for(_args("--sizes", "1GiB,10GiB"))}
    assert {label: c.slow_peers for label, c in cases.items()} == {"1GiB": True, "gpt2": True, "llama": False,
                                                                   "10GiB": False}
    rounds = {label: bench.repeats_for(c.nbytes, _args()) for label, c in cases.items()}
    assert rounds == {"1GiB": 3, "gpt2": 9, "llama": 3, "10GiB": 3}
    assert bench.repeats_for(cases["gpt2"].nbytes, _args("--repeats", "4")) == 4
    assert all(c.slow_peers for c in bench.cases_for(_args("--sizes", "1GiB,10GiB", "--full")))


def test_a_state_above_the_slow_peers_size_loads_without_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setattr(bench, "SLOW_PEERS_MAX_BYTES", 3 * 2**20)
    args = _args("--quick", "--sizes", "1MiB,4MiB", "--layouts", "none", "--dir", str(tmp_path), "--device", "cpu")
    loads = [row.variant for row in bench.run(args).rows if " load -> " in row.variant]
    assert loads == ["1MiB load -> cpu: safetensors load_file", "1MiB load -> cpu: torch.load(mmap)+.to",
                     "1MiB load -> cpu: torchplace.load",
                     "4MiB load -> cpu: safetensors load_file", "4MiB load -> cpu: torchplace.load"]
    assert list(tmp_path.iterdir()) == []
