"""Registration of the `archspec` model type with transformers' Auto classes."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .config import ArchspecConfig
from .model import ArchspecForCausalLM
from .tokenizer import ByteTokenizer


def register() -> None:
    """Make `AutoConfig`, `AutoModelForCausalLM` and `AutoTokenizer` know the `archspec`
    model type (idempotent: importing `archspec.hf` calls it)."""
    AutoConfig.register(ArchspecConfig.model_type, ArchspecConfig, exist_ok=True)
    AutoModelForCausalLM.register(ArchspecConfig, ArchspecForCausalLM, exist_ok=True)
    AutoTokenizer.register(ArchspecConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)
