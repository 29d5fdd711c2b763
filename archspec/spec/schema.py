"""The JSON Schema of model specs, for editors (yaml-language-server) and other tools."""

from __future__ import annotations

import json
from typing import Any

from archspec.spec.models import Spec

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def spec_json_schema() -> dict[str, Any]:
    """The schema pydantic derives from `Spec`, with its dialect declared."""
    return {"$schema": JSON_SCHEMA_DIALECT, **Spec.model_json_schema()}


def spec_json_schema_text() -> str:
    """The schema as the stable, diff-friendly text `archspec schema` writes."""
    return json.dumps(spec_json_schema(), indent=2) + "\n"
