"""Sizes and durations as the CLI and API accept them, and bytes as torchplace prints them."""

from __future__ import annotations

import doctest

import pytest

from torchplace import units
from torchplace.units import format_bytes, parse_duration, parse_size, size_label


@pytest.mark.parametrize("text,expected", [("20GiB", 20 * 2**30), ("20gib", 20 * 2**30), ("40GB", 40 * 10**9),
                                           ("1.5G", 1_500_000_000), ("512 MiB", 512 * 2**20), ("4096", 4096), (7, 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_a_bare_number_is_bytes_unless_the_caller_names_the_unit():
    assert parse_size("2") == 2
    assert parse_size("2", bare="GiB") == 2 * 2**30 and parse_size("2MiB", bare="GiB") == 2 * 2**20
    with pytest.raises(ValueError, match="a bare number is GiB"):
        parse_size("lots", bare="GiB")


@pytest.mark.parametrize("text,expected", [("10m", 600.0), ("30s", 30.0), ("1.5h", 5400.0), ("90", 90.0), (2, 2.0)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("parse,text,match", [(parse_size, "lots", "size 'lots' is not understood"),
                                              (parse_size, "20GiBs", "units: b, k"),
                                              (parse_duration, "5x", "duration '5x' is not understood")])
def test_errors_name_the_value(parse, text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


@pytest.mark.parametrize("text,expected", [("1e3MB", 10**9), ("1.5e1GiB", 15 * 2**30), ("2E2", 200)])
def test_a_size_in_scientific_notation_is_read(text, expected):
    assert parse_size(text) == expected
    assert parse_duration("1e2s") == 100.0


@pytest.mark.parametrize("parse,text,match", [(parse_size, "-5MB", "size '-5MB' is negative; a size is 0 or more"),
                                              (parse_duration, "-1s", "duration '-1s' is negative"),
                                              (parse_size, "1e400GB", "larger than any memory"),
                                              (parse_duration, "1e400h", "is infinite")])
def test_negative_and_endless_values_say_so(parse, text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


@pytest.mark.parametrize("n,expected", [(None, "?"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                        (3 * 2**29, "1.5 GiB"), (-5 * 2**20, "-5.0 MiB"), (3 * 2**40, "3.0 TiB")])
def test_format_bytes_picks_the_unit(n, expected):
    assert format_bytes(n) == expected


def test_format_bytes_in_a_fixed_unit():
    assert format_bytes(2**29, "GiB") == "0.5 GiB" and format_bytes(64 * 2**20, "MiB", digits=0) == "64 MiB"


@pytest.mark.parametrize("n", [2**30, 10 * 2**30, 512 * 2**20, 3 * 2**29])
def test_size_label_reads_back(n):
    assert parse_size(size_label(n)) == n


def test_docstring_examples():
    assert doctest.testmod(units).failed == 0
