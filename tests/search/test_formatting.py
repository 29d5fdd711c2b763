"""The one number format of archspec's tables."""

import pytest

from archspec.search.formatting import number


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "-"),
        (1852800.0, "1,852,800"),  # a whole number is written whole at any size
        (58704, "58,704"),
        (97514.7, "97,515"),  # large fractions: the fraction is noise
        (0.99712, "0.9971"),
        (12.3456, "12.35"),
        (3.2e-05, "3.2e-05"),
        (0.0, "0"),
        (float("nan"), "nan"),
        (2.5e18, "2.5e+18"),
        (True, "True"),
        ("x", "x"),
    ],
)
def test_number(value, text):
    assert number(value) == text
