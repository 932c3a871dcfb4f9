"""Judging a target on repeated measurements: the median is shown, the worse quartile decides."""

from __future__ import annotations

import pytest

from torchplace.bench.common import Target, judged, plain, ratios, spread, timed_rounds


def test_a_target_is_met_only_if_the_worse_end_of_the_spread_meets_it() -> None:
    stall = judged("stall", [1.0, 1.1, 1.15, 1.3, 1.5], 1.2, "<=")  # median 1.15 meets 1.2; q3 (1.3) does not
    assert stall.measured == pytest.approx(1.15) and stall.spread == pytest.approx((1.1, 1.3))
    assert stall.worst == pytest.approx(1.3) and not stall.met
    load = judged("GB/s", [38.0, 41.0, 42.0, 43.0, 44.0], 40.0, ">=")  # for ">=" the low quartile decides
    assert load.worst == pytest.approx(41.0) and load.met
    assert not judged("GB/s", [30.0, 39.0, 42.0, 43.0], 40.0, ">=").met
    assert "judged at 1.3" in stall.describe() and "[1.1..1.3]" in stall.describe()


def test_one_value_and_a_plain_target() -> None:
    one = judged("x", [2.0], 1.5, ">=")
    assert one.spread == (2.0, 2.0) and one.met
    bare = Target("count", 0.0, 0.0)
    assert bare.worst == 0.0 and bare.met and bare.describe() == "0 <= 0"
    assert spread([])["n"] == 0


def test_ratios_pair_rounds_or_every_pair() -> None:
    assert ratios([2.0, 4.0], [1.0, 2.0]) == [2.0, 2.0]
    assert ratios([2.0, 4.0], [2.0]) == [1.0, 2.0]  # a peer timed once is set against every round


def test_rounds_interleave_with_a_rotating_order_and_slow_variants_run_once() -> None:
    order: list[str] = []

    def variant(name: str, slow: bool = False):
        def fn() -> None:
            order.append(name)
            if slow and len([o for o in order if o == name]) == 1:
                import time
                time.sleep(0.5)  # only its untimed warm-up is slow: enough to mark it
        return plain(fn)

    times = timed_rounds({"a": variant("a"), "b": variant("b"), "c": variant("c", slow=True)}, 3, slow_s=0.2)
    assert order == ["a", "b", "c", "a", "b", "c", "b", "a", "a", "b"]  # warm-ups, then rotated rounds; c once
    assert [len(times[k]) for k in "abc"] == [3, 3, 1]
    order.clear()  # a variant tried before (its trial's seconds given) is not warmed up again
    times = timed_rounds({"a": variant("a"), "b": variant("b")}, 2, slow_s=0.2, warmed={"b": 1.0})
    assert order == ["a", "a", "b", "a"] and [len(times[k]) for k in "ab"] == [2, 1]
