"""`archspec export RUN --hf DIR`: a trained model as a HuggingFace model directory.

RUN is a weights directory (an `archspec train` run, or a search trial's
`trials/NNNNN/<task>/`). transformers is imported only when the command runs (the extra
`archspec-lrnn[hf]`).
"""

from __future__ import annotations

import argparse

from archspec.errors import ArchspecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a trained model as a HuggingFace model directory (needs archspec-lrnn[hf])",
        description="Write the model in RUN (model.safetensors + spec.yaml, as archspec train and every search "
        "trial save it) as a HuggingFace directory: AutoModelForCausalLM.from_pretrained(DIR), generate(), "
        "lm-evaluation-harness.",
    )
    p.add_argument("run", metavar="RUN", help="a training run's directory, or a search trial's trials/NNNNN/<task>")
    p.add_argument("--hf", required=True, metavar="DIR", help="output directory of the HuggingFace model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from archspec.hf.export import export
    except ImportError as exc:
        raise ArchspecError(f"archspec export needs transformers: pip install 'archspec-lrnn[hf]' ({exc})") from None
    out = export(args.run, args.hf)
    print(f"wrote {out} (AutoModelForCausalLM.from_pretrained('{out}') after `import archspec.hf`, "
          "or with trust_remote_code=True)")
    return 0
