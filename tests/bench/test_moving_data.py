"""`torchplace bench transfer` and `bench loader`: which variants run, how rounds are ordered, and
what the memory check reports. CPU runs (`--quick`); the GPU run is in test_moving_data_gpu.py."""

from __future__ import annotations

import argparse

import pytest

from torchplace.bench import loader as bench_loader
from torchplace.bench import packed as pk
from torchplace.bench import transfer as bench_transfer
from torchplace.bench.steps import Env, Variant, measure, paired_ratio


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_transfer_measures_copies_only_then_a_step_with_compute():
    result = bench_transfer.run(_args(bench_transfer, "--quick", "--device", "cpu", "--tensors", "8", "--shape", "4x4",
                                      "--structure", "synthetic"))
    names = [row.variant for row in result.rows]
    copies_only = names[:names.index("one pre-packed pinned copy") + 1]
    assert copies_only[0] == "naive .to(), pageable" and all("compute" not in n for n in copies_only)
    with_compute = names[len(copies_only):]
    suffix = f", {result.params['compute_ms']:.2f} ms compute"
    assert with_compute and all(n.endswith(suffix) for n in with_compute)
    assert with_compute[-2:] == ["compute only, batch on device" + suffix, "ideal max(compute, copy)" + suffix]
    assert result.targets == []  # nothing is copied on the CPU: the targets would mean nothing
    assert any("no pinned memory" in note for note in result.notes)


def test_transfer_packed_in_workers_for_the_recommender_batch_reports_host_and_cpu_ratios():
    result = bench_transfer.run(_args(bench_transfer, "--quick", "--device", "cpu", "--structure", "recsys",
                                      "--compute-ms", "0", "--workers", "2", "--bulk-mib", "0"))
    names = [row.variant for row in result.rows]
    assert all(n.endswith(" [recsys]") for n in names)
    assert "torchplace packed_collate + DeviceLoader, pinned [recsys]" in names
    assert "DataLoader, 2 workers, packed_collate + torchplace DeviceLoader [recsys]" in names
    assert "DataLoader, 2 workers, packed_collate(slots=0) + torchplace DeviceLoader [recsys]" in names  # as before
    assert all(row.extra["cpu µs/step"] > 0 for row in result.rows)  # the training process's CPU per step
    assert set(result.params["packed_recsys"]) >= {"host_vs_one_packed_copy", "dataloader_host_vs_one_packed_copy",
                                                   "dataloader_cpu_slots_vs_slots_0"}
    assert result.targets == []  # nothing is copied on the CPU


def test_transfer_with_no_compute_has_no_step_rows():
    result = bench_transfer.run(_args(bench_transfer, "--quick", "--device", "cpu", "--tensors", "4",
                                      "--shape", "2x2", "--compute-ms", "0"))
    assert result.params["compute_ms"] == 0.0
    assert all("compute" not in row.variant for row in result.rows)


def test_each_round_starts_at_another_variant_and_the_median_is_kept():
    order: list[str] = []

    def variant(name: str, ms: list[float]) -> Variant:  # a variant that reports MS, one value per round
        calls = iter(ms)
        v = Variant(name, lambda: iter(()))
        v.per_step_ms = lambda sync: (order.append(name), next(calls))[1]  # type: ignore[method-assign]
        return v

    variants = [variant("a", [9, 1, 2, 3]), variant("b", [9, 5, 6, 7]), variant("c", [9, 8, 8, 30])]
    medians = measure(variants, 3, lambda: None, title="test")
    assert medians == {"a": 2, "b": 6, "c": 8}  # the warm-up values (9) are not kept
    rounds = [order[i:i + 3] for i in range(0, 12, 3)]
    assert rounds[0] == ["a", "b", "c"]  # warm-up
    assert [r[0] for r in rounds[1:]] == ["a", "b", "c"]  # each timed round starts elsewhere
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


def test_loader_bench_runs_every_variant_on_cpu_and_skips_the_memory_check():
    result = bench_loader.run(_args(bench_loader, "--quick", "--device", "cpu", "--size-mib", "1", "--epochs", "1"))
    names = [row.variant for row in result.rows]
    assert names[0] == "naive .to(), pageable" and names[-1] == "ideal max(compute, copy)"
    assert any("no caching allocator" in note for note in result.notes)
    assert "reserved_growth_mib" not in result.params


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_memory_check_needs_a_caching_allocator(device):
    import torch

    assert bench_loader._reserved_per_epoch_mib([], lambda b: None, 2, Env.for_device(torch.device(device))) is None


def test_paired_ratio_alternates_which_call_goes_first():
    calls: list[str] = []

    def a(item):
        calls.append(f"a{item}")

    def b(item):
        calls.append(f"b{item}")

    ratio = paired_ratio(a, b, [0, 1, 2, 3], 2, lambda: None)
    assert calls[:8] == ["a0", "b0", "b1", "a1", "a2", "b2", "b3", "a3"]
    assert len(calls) == 3 * 8  # one untimed round, then two
    assert ratio > 0


def test_paired_cpu_alternates_blocks_and_drains_the_pipeline():
    """bench transfer's CPU ratio of the packed loader to send_to_device: blocks of batches alternate
    (which side goes first too), each round takes a fresh iterator and drains what it holds beyond the
    items, untimed; the value is a ratio of CPU times (its size is the benchmark's business)."""
    calls: list[str] = []
    made: list[int] = []

    def ours():
        made.append(1)
        for i in range(5):  # one more than the items: a pipeline holding a batch ahead
            calls.append(f"o{i}")
            yield sum(range(2000))

    def theirs(item):
        calls.append(f"t{item}")
        return sum(range(4000))

    ratio = pk.paired_cpu(ours, theirs, [0, 1, 2, 3], 2, lambda: None, block=2)
    assert calls[:10] == ["o0", "o1", "t0", "t1", "t2", "t3", "o2", "o3", "o4", "o0"]
    assert len(made) == 3  # one untimed round, then two
    assert ratio > 0
