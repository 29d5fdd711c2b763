"""archspec: a declarative architecture-search toolkit for linear-RNN sequence mixers.

`load_spec` reads and validates a spec, `lower` turns it into the `ModelPlan` IR,
`compile` builds the `nn.Module`, `load` rebuilds a trained one from its weights directory
(`model.safetensors` and `spec.yaml`, `archspec/weights.py`). Attributes load lazily so that `import archspec`
stays cheap and `archspec.kernels` can be imported without pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from archspec.compiler import compile
    from archspec.lowering import lower
    from archspec.spec.loader import load_spec
    from archspec.spec.models import Spec
    from archspec.weights import load

__all__ = ["load_spec", "lower", "compile", "load", "Spec"]

_EXPORTS = {
    "load_spec": "archspec.spec.loader",
    "Spec": "archspec.spec.models",
    "lower": "archspec.lowering",
    "compile": "archspec.compiler",
    "load": "archspec.weights",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        # The modules are named lowering/compiler, not lower/compile: importing a submodule
        # sets the package attribute of its name, which would shadow these functions.
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'archspec' has no attribute {name!r}")
