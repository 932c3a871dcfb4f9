"""StragglerReport's sentence, built from numbers (no process group needed)."""

from __future__ import annotations

from torchplace.distributed.health import StragglerReport


def test_one_rank_says_one_rank():
    text = StragglerReport(step_times_s=[0.3], median_s=0.3, slow_ranks=[], threshold=1.5).describe()
    assert text == "No straggler: one rank, step time 0.3 s (nothing to compare with)."
    assert "1 ranks" not in text


def test_several_ranks_give_the_spread():
    text = StragglerReport(step_times_s=[0.2, 0.4], median_s=0.3, slow_ranks=[], threshold=1.5).describe()
    assert text == "No straggler: step times 0.2-0.4 s across 2 ranks (median 0.3 s)."
