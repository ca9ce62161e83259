"""Sizes on the command line: binary units, with or without the 'iB'."""

import pytest

from pagedkv.core.config import parse_bytes
from pagedkv.core.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ("1G", 2**30), ("512M", 512 * 2**20), ("64k", 64 * 2**10), ("1GiB", 2**30), ("2GB", 2 * 10**9),
    ("0.5GiB", 2**29), ("1000", 1000), ("1 GiB", 2**30), ("1T", 2**40),
])
def test_sizes_read_binary_units_with_or_without_ib(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["infGiB", "nanM", "-1G", "1e40G", "lots", "G"])
def test_impossible_sizes_are_one_clear_error(text):
    with pytest.raises(ConfigError, match=repr(text).replace("+", r"\+")):
        parse_bytes(text)
