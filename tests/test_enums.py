import pytest

from memcheck.enums import Device, Precision
from memcheck.errors import UsageError


def test_parse_accepts_the_strings_users_type():
    assert Device.parse("CPU") is Device.CPU
    assert Precision.parse("amp-bf16") is Precision.AMP_BF16


def test_parse_error_lists_allowed_values_and_suggests_the_closest():
    with pytest.raises(UsageError) as err:
        Precision.parse("bf61", what="precision")
    message = str(err.value)
    assert "'bf61'" in message and "did you mean 'bf16'" in message and "fp32" in message
