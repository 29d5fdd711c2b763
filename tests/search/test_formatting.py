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


def test_short_names_and_labels():
    from archspec.search.formatting import overrides_label, short_fields

    names = ["mixer.transition.type", "mixer.preconditioner.type", "mixer.transition.n_h"]
    assert short_fields(names) == {"mixer.transition.type": "transition.type",
                                   "mixer.preconditioner.type": "preconditioner.type", "mixer.transition.n_h": "n_h"}
    overrides = {"mixer.transition.type": "diagonal", "mixer.transition.n_h": 1, "mixer.transition.beta_range": None}
    assert overrides_label(overrides) == "type=diagonal n_h=1"
    assert overrides_label({"mixer.transition.beta_range": [0, 2]}) == "beta_range=[0, 2]"
