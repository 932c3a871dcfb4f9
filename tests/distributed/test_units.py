"""Sizes and durations as the CLI and API accept them."""

from __future__ import annotations

import pytest

from torchplace.distributed.units import format_bytes, parse_duration, parse_size


@pytest.mark.parametrize("text,expected", [("20GiB", 20 * 2**30), ("20gib", 20 * 2**30), ("40GB", 40 * 10**9),
                                           ("1.5G", 1_500_000_000), ("512 MiB", 512 * 2**20), ("4096", 4096), (7, 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,expected", [("10m", 600.0), ("30s", 30.0), ("1.5h", 5400.0), ("90", 90.0), (2, 2.0)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("parse,text,match", [(parse_size, "lots", "size 'lots' is not understood"),
                                              (parse_size, "20GiBs", "units: b, k"),
                                              (parse_duration, "5x", "duration '5x' is not understood")])
def test_errors_name_the_value(parse, text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


def test_format_bytes():
    assert format_bytes(None) == "?" and format_bytes(3 * 2**29) == "1.5 GiB"
