"""Every test module imports without Ray, as the developers' guide requires: the GPU
machine has no Ray, and one module that imports it at import time stops pytest's
collection there, so no GPU test runs at all. Collected here in a fresh interpreter
with `ray` made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COLLECT_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # `import ray` (and every ray.* submodule) now raises ImportError
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_test_module_is_collected_without_ray():
    done = subprocess.run([sys.executable, "-c", COLLECT_WITHOUT_RAY], cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR ")]
    assert done.returncode == 0 and not errors, "\n".join(errors) or done.stdout[-2000:] + done.stderr[-2000:]
