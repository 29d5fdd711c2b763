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
