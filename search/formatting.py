"""One way to write a metric's value in every table archspec prints.

Whole numbers (parameters, FLOPs, bytes) with thousands separators at any size, so that
a column of them lines up and compares at a glance (`1,852,800`, never `1.8528e+06`);
large fractional values (tokens per second) rounded to whole numbers the same way; the
rest (accuracies, losses, ratios) to four significant digits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
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


def short_fields(names: Sequence[str]) -> dict[str, str]:
    """Each dotted name's shortest tail that no other name shares: `mixer.transition.n_h` ->
    `n_h`, but `preconditioner.type` and `transition.type` stay apart."""
    short = {}
    for name in names:
        parts = name.split(".")
        for size in range(1, len(parts) + 1):
            tail = ".".join(parts[-size:])
            if not any(other != name and (other == tail or other.endswith("." + tail)) for other in names):
                break
        short[name] = tail
    return short


def override_value(value: Any) -> str:
    """A sampled field's value in a table or a plot label. `None` (the field left unset,
    e.g. the beta range of a diagonal transition, which has none) is `-`, as a missing
    metric is."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return json.dumps(value)
    return number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def overrides_label(overrides: Mapping[str, Any], names: Sequence[str] | None = None) -> str:
    """`type=householder n_h=2 beta_range=[0, 2]`: a trial's overrides by the tables'
    short field names (`names`: the fields to tell apart, default its own); fields left
    unset are left out."""
    short = short_fields(list(names if names is not None else overrides))
    return " ".join(f"{short[k]}={override_value(v)}" for k, v in overrides.items() if k in short and v is not None)
