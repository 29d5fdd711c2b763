"""One way to write a metric's value in every table archspec prints.

Whole numbers (parameters, FLOPs, bytes) with thousands separators at any size, so that
a column of them lines up and compares at a glance (`1,852,800`, never `1.8528e+06`);
large fractional values (tokens per second) rounded to whole numbers the same way; the
rest (accuracies, losses, ratios) to four significant digits.
"""

from __future__ import annotations

import math
from typing import Any

# Below this a fractional value keeps its digits after the point (0.9971, 12.35);
# at or above it the fraction is noise next to the whole part (97,515 tokens/s).
WHOLE_FROM = 1000.0
# Above this a float is no longer an exact whole number: write it in exponent form.
EXACT_WHOLE_BELOW = 1e15


def number(value: Any) -> str:
    """A metric value as text: `-` for none, `nan`/`inf` as such, see the module doc."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if abs(value) >= EXACT_WHOLE_BELOW:
        return f"{value:.4g}"
    if isinstance(value, int) or float(value).is_integer() or abs(value) >= WHOLE_FROM:
        return f"{value:,.0f}"
    return f"{value:.4g}"
