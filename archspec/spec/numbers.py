"""Numbers in specs: finite, never a boolean, and (in a model spec) of a sane magnitude.

pydantic's lax mode reads `heads: yes` as 1 and `.inf` as a float that passes `> 0`; the
YAML reader refuses non-finite values already (`yaml_source`), this mixin refuses them in
data that comes from Python too. Sizes are bounded so that the cost model's arithmetic
(products of sizes, `head_dim * expand_v`) stays finite: a model spec whose numbers are
merely large is refused later, by the memory estimate (`archspec.memory`), with its size.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Beyond 2**53 a float no longer holds every whole number; no size, rate or count in a
# model spec comes near it.
MAX_SPEC_MAGNITUDE = float(2**53)


def _numeric_kinds(annotation: Any) -> set[type]:
    """The number types (`int`, `float`) an annotation holds, through Optional, unions,
    tuples and lists; empty for anything else (`Any`, str, models)."""
    if annotation in (int, float):
        return {annotation}
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _numeric_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, tuple, list):
        return {kind for arg in typing.get_args(annotation) if arg is not Ellipsis for kind in _numeric_kinds(arg)}
    return set()


def number_problem(value: Any, annotation: Any, limit: float | None) -> str | None:
    """Why `value` cannot be the number(s) `annotation` asks for, or None."""
    if not _numeric_kinds(annotation):
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, bool):
            return (f"got {str(item).lower()}, a boolean, where a number belongs (YAML reads yes/no/on/off "
                    "as booleans); write the number")
        if isinstance(item, float) and not math.isfinite(item):
            return f"got {item}: not a finite number (infinities and NaN pass range checks and fail later)"
        if limit is not None and isinstance(item, (int, float)) and abs(item) > limit:
            return f"got {item:g}, beyond {limit:,.0f} (2**53), the largest magnitude a model spec accepts"
    return None


class StrictNumbers(BaseModel):
    """A base for spec sections: no NaN or infinity, no booleans for numbers, and at most
    `number_limit` in magnitude when a section sets one."""

    model_config = ConfigDict(allow_inf_nan=False)
    number_limit: ClassVar[float | None] = None

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        problem = number_problem(value, field.annotation, cls.number_limit) if field is not None else None
        if problem:
            raise ValueError(problem)
        return value
