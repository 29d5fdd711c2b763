"""`ArchspecConfig`: an archspec model's fully resolved spec as a transformers config.

The spec document (what `spec.yaml` of a weights directory holds) is the one source of the
architecture; the standard fields transformers reads (`vocab_size`, `hidden_size`,
`num_hidden_layers`, `tie_word_embeddings`, `layer_types`) are derived from it, and
`config.json` carries both. `from_pretrained` rebuilds the module from the spec through
archspec's compiler, so an exported directory needs archspec installed, not its YAML files.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from archspec.errors import ArchspecError


class ArchspecConfig(PretrainedConfig):
    model_type = "archspec"

    spec: dict | None = None  # the fully resolved archspec spec (spec.yaml's document)
    vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 2
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        if self.spec is not None:
            plan = self.plan()
            self.vocab_size = plan.vocab_size
            self.hidden_size = plan.d_model
            self.num_hidden_layers = plan.layers
            self.tie_word_embeddings = plan.tie_embeddings
        super().__post_init__(**kwargs)

    def plan(self):
        """The `ModelPlan` the spec lowers to (errors name the spec's fields)."""
        from archspec.lowering import lower
        from archspec.spec.loader import load_spec

        if self.spec is None:
            raise ArchspecError("this ArchspecConfig holds no spec: build it with ArchspecConfig(spec=...)")
        return lower(load_spec(dict(self.spec)))

    @property
    def layer_types(self) -> list[str]:
        """Per layer, the kind transformers knows it by: recurrent layers are its
        `linear_attention` (a fixed-size state, no keys and values per token), attention
        layers `full_attention` or, with a window, `sliding_attention`."""
        if self.spec is None:
            return ["linear_attention"] * self.num_hidden_layers
        kinds = []
        for layer in self.plan().layer_plans:
            if getattr(layer, "kind", "recurrent") != "attention":
                kinds.append("linear_attention")
            else:
                kinds.append("full_attention" if layer.window is None else "sliding_attention")
        return kinds
