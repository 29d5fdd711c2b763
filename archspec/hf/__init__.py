"""archspec models as HuggingFace transformers models: the optional extra `archspec-lrnn[hf]`.

Importing this package needs `transformers` (the core of archspec does not): it registers
the `archspec` model type with `AutoConfig`, `AutoModelForCausalLM` and `AutoTokenizer`,
so that `AutoModelForCausalLM.from_pretrained(DIR)` rebuilds an exported model, and
`generate()` (GenerationMixin), `save_pretrained` / `from_pretrained` (safetensors) and
lm-evaluation-harness work as for any causal LM.

- `config.py`: `ArchspecConfig`, the resolved spec inside a `PreTrainedConfig`.
- `model.py`: `ArchspecForCausalLM` (`PreTrainedModel` + `GenerationMixin`) around the
  compiled `LanguageModel`; `from_archspec(model, spec)`.
- `cache.py`: `ArchspecCache`, a transformers `Cache` of per-layer decoding states.
- `tokenizer.py`: `ByteTokenizer`, token id = byte, for byte-level models.
- `export.py`: `export(weights_dir, out_dir)`, behind `archspec export RUN --hf DIR`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path


def _installed_kernels_first() -> None:
    """transformers (5.25 on) imports Hugging Face's `kernels` package. With a checkout of
    archspec's root on `sys.path` (`python -m pytest` or `python -c` run there), the
    checkout's top-level `kernels/` folder (`archspec.kernels` once installed) is found
    under that name first, and transformers fails on it. Load the installed distribution's
    package as `kernels` before transformers looks; nothing changes where none is
    installed or nothing shadows it."""
    try:
        init = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return
    loaded = sys.modules.get("kernels")
    if loaded is not None or not init.is_file():
        return
    found = importlib.util.find_spec("kernels")
    if found is None or found.origin is None or Path(found.origin).resolve() == init.resolve():
        return
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


_installed_kernels_first()

try:
    import transformers  # noqa: F401
except ImportError as exc:  # the extra is not installed: say how to get it
    raise ImportError(
        "archspec.hf needs the HuggingFace transformers library: pip install 'archspec-lrnn[hf]'"
    ) from exc

from .cache import ArchspecCache
from .config import ArchspecConfig
from .model import ArchspecForCausalLM
from .tokenizer import ByteTokenizer
from .registration import register

register()

__all__ = ["ArchspecCache", "ArchspecConfig", "ArchspecForCausalLM", "ByteTokenizer", "register"]
