"""`export(source, out)`: a trained archspec model as a HuggingFace model directory.

`source` is a weights directory (`model.safetensors` + `spec.yaml`: an `archspec train`
run, or a search trial's `trials/NNNNN/<task>/`). The result is what `save_pretrained`
writes (`config.json` with the resolved spec, `model.safetensors`,
`generation_config.json`), the byte tokenizer's files for a byte-level model (vocabulary
256), and three small modules that re-export archspec's classes with `auto_map`
entries, so that a process that never imported `archspec.hf` (lm-evaluation-harness's
command line, `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`) finds
them; archspec itself must be installed there.
"""

from __future__ import annotations

import os
from pathlib import Path

from archspec.atomic import write_text_atomic
from archspec.errors import ArchspecError

from .model import ArchspecForCausalLM
from .tokenizer import BYTES, ByteTokenizer

# module name -> (class it re-exports, the Auto class that finds it)
REMOTE_CODE = {
    "configuration_archspec": ("archspec.hf.config", "ArchspecConfig", "AutoConfig"),
    "modeling_archspec": ("archspec.hf.model", "ArchspecForCausalLM", "AutoModelForCausalLM"),
    "tokenization_archspec": ("archspec.hf.tokenizer", "ByteTokenizer", "AutoTokenizer"),
}


def _remote_code_modules(out: Path, byte_level: bool) -> dict:
    auto_map: dict = {}
    for module, (source, name, auto) in REMOTE_CODE.items():
        if auto == "AutoTokenizer" and not byte_level:
            continue
        text = (f'"""Written by `archspec export`: {name} from the installed archspec package."""\n\n'
                f"from {source} import {name}  # noqa: F401\n")
        write_text_atomic(out / f"{module}.py", text)
        auto_map[auto] = f"{module}.{name}" if auto != "AutoTokenizer" else [f"{module}.{name}", None]
    return auto_map


def export(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the HuggingFace directory of the weights in `source` to `out`."""
    import yaml

    from archspec.weights import SPEC_FILE, weights_dir

    source_path = Path(source)
    if (source_path / "search.yaml").is_file() and (source_path / "trials").is_dir():
        raise ArchspecError(f"{source_path} is a search's run directory: export one trial's model, "
                            f"e.g. {source_path / 'trials' / '00000' / '<task>'}")
    directory = weights_dir(source_path)
    if not (directory / SPEC_FILE).is_file():
        raise ArchspecError(f"{directory}: no {SPEC_FILE} beside the weights; export needs the resolved spec")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArchspecError(f"{out} exists and is not a directory")

    from archspec.weights import load

    model = load(directory)
    spec = yaml.safe_load((directory / SPEC_FILE).read_text(encoding="utf-8"))
    wrapped = ArchspecForCausalLM.from_archspec(model, spec)
    byte_level = wrapped.config.vocab_size == BYTES
    if byte_level:
        tokenizer = ByteTokenizer()
        for config in (wrapped.config, wrapped.generation_config):
            config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    wrapped.config.auto_map = _remote_code_modules(out, byte_level)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    if byte_level:
        tokenizer.save_pretrained(out)
        _add_tokenizer_auto_map(out)
    return out


def _add_tokenizer_auto_map(out: Path) -> None:
    """tokenizer_config.json names the tokenizer's module for `trust_remote_code`."""
    import json

    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoTokenizer": ["tokenization_archspec.ByteTokenizer", None]}
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


__all__ = ["export"]
