"""gems.units: sizes parse in binary (GiB, G) and decimal (GB) units and print in binary."""
from __future__ import annotations

import pytest

from gems.errors import GemsError
from gems.units import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("123", 123), ("123B", 123), ("0", 0), (" 40GiB ", 40 * 2**30), ("40 GiB", 40 * 2**30),
    ("40gib", 40 * 2**30), ("40G", 40 * 2**30), ("1.5G", 3 * 2**29), ("512MiB", 512 * 2**20),
    ("512M", 512 * 2**20), ("64KiB", 65536), ("2TiB", 2 * 2**40), ("40GB", 40 * 10**9),
    ("40MB", 40 * 10**6), ("1kb", 1000), ("1e3", 1000), (".5KiB", 512), ("1.9", 1), (7, 7),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["40GB?", "", "GiB", "-1", "40 XB", "4O", "1,5G", "40GiBs", "nan", "1e999G"])
def test_parse_size_rejects_with_the_valid_forms(text):
    with pytest.raises(GemsError, match="40GiB"):
        parse_size(text)


def test_parse_size_rejects_negative_and_bool():
    with pytest.raises(GemsError):
        parse_size(-5)
    with pytest.raises(GemsError):
        parse_size(True)


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3 * 2**29, "1.50 GiB"),
    (40 * 2**30, "40.00 GiB"), (5 * 2**40, "5.00 TiB"), (2**52, "4096.00 TiB"),
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


def test_round_trip():
    for n in (1, 4096, 123456789, 40 * 2**30):
        assert abs(parse_size(format_size(n).replace(" ", "")) - n) <= n * 0.005
