import pytest

from memcheck.errors import UsageError
from memcheck.units import GiB, MiB, format_bytes, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 2**30),  # binary
        ("24 GB", 24 * 10**9),  # SI means SI
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),  # 1.5 * 2**30 = 3 * 2**29
        ("80G", 80 * 2**30),  # a bare G is binary, as torch and nvidia-smi print it
        ("4096", 4096),
    ],
)
def test_parse_size_understands_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24 parsecs", "-1GiB", "0"])
def test_parse_size_rejects_bad_values_naming_them(text):
    with pytest.raises(UsageError, match="--gpu-memory"):
        parse_size(text, what="--gpu-memory")


def test_format_bytes_labels_binary_units():
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(12 * MiB) == "12.0 MiB"
    assert format_bytes(512) == "512 B"
