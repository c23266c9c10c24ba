import pytest
import torch

from memcheck.errors import UsageError
from memcheck.units import GiB, MiB, ceil_div, format_bytes, nbytes, parse_size, round_up


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


def test_ceil_div_and_round_up():
    assert ceil_div(1000, 64) == 16  # 15 * 64 = 960 < 1000 <= 1024 = 16 * 64
    assert ceil_div(1024, 64) == 16  # exact: no extra block
    assert ceil_div(0, 64) == 0
    assert round_up(1000, 512) == 1024  # ceil(1000 / 512) = 2 blocks of 512
    assert round_up(1024, 512) == 1024
    assert round_up(130, 128) == 256  # flash's round128(L_q): 2 * 128


def test_nbytes_counts_elements_times_their_size():
    assert nbytes(torch.empty(3, 5, dtype=torch.float16, device="meta")) == 30  # 15 elements * 2 B
    assert nbytes(torch.empty(0, device="meta")) == 0
    assert nbytes(None) == 0
    assert nbytes(3.0) == 0  # not a tensor
    assert nbytes(torch.Tensor) == 0  # the class, not a tensor
