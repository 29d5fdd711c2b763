"""Every example in README.md and the researcher's docs does what its text says.

The commands and Python blocks are read from the files themselves; `PLANS` says for each
how it is run here: as written, at a reduced size (the change is written next to it,
and the text says the test runs it so), or not at all, with the reason (it needs CUDA,
it is this suite, or it is the same command as one that runs). An example added to or
changed in the docs without a plan here fails `test_every_example_has_a_plan`, so the
docs cannot drift from what runs.

Each runs through the `archspec` entry point in a scratch directory whose `specs/` is
the repository's, in the order the docs give them (the pareto and resume examples read
the run the search example made). The README's first training runs in full: its claim
is that the model learns.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/search.md", "docs/tasks.md", "docs/spec-language.md")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.ray]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(lines)))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def doc_examples() -> list[tuple[str, str]]:
    """(file, example) in document order: each shell command (continuations joined,
    comments dropped, words normalised) and each Python block."""
    found = []
    for doc in DOCS:
        for lang, body in fenced_blocks((REPO / doc).read_text()):
            if lang in ("bash", "sh"):
                for line in body.replace("\\\n", " ").splitlines():
                    words = shlex.split(line, comments=True)
                    if words:
                        found.append((doc, shlex.join(words)))
            elif lang == "python":
                found.append((doc, body.strip()))
    return found


@dataclass(frozen=True)
class Plan:
    """How an example runs here: `replace` turns the documented text into what runs
    (a reduced size); `check(cwd, out)` asserts what the text says it shows; `skip` is
    why it does not run."""

    check: Callable[[Path, str], None] | None = None
    replace: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    skip: str | None = None


# --------------------------------------------------------------------------- what each shows


def read_metrics(cwd: Path, out: str) -> dict:
    return json.loads((cwd / out / "metrics.json").read_text())


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:4] == b"\x89PNG"


def validated_models(cwd: Path, out: str) -> None:
    lines = out.splitlines()
    assert len(lines) == len(glob.glob(str(REPO / "specs" / "models" / "*.yaml"))) >= 12
    assert all(line.startswith("ok  specs/models/") and "(model spec " in line for line in lines)


def validated_kinds(cwd: Path, out: str) -> None:
    search, experiment = out.splitlines()
    assert search.startswith("ok  specs/search/demo.yaml  (search spec demo: 3 searched fields, 13 points")
    assert experiment.startswith("ok  specs/experiments/deltaproduct-s3.yaml  (experiment deltaproduct-s3: 4 runs")


def compiled(name: str, overrides: dict) -> Callable[[Path, str], None]:
    def check(cwd: Path, out: str) -> None:
        import archspec

        params = sum(p.numel() for p in archspec.compile(REPO / "specs" / "models" / f"{name}.yaml", **overrides).parameters())
        for words in (f"{name}: plan", "FLOPs/token", "state bytes", f"{params:,}"):
            assert words in out, words
    return check


def dp2_learns_s3(cwd: Path, out: str) -> None:
    """The README: learns S3 and stops early (about 700 steps), token accuracy 0.995 and
    whole sequences 0.93 at twice the training length."""
    record = read_metrics(cwd, "runs/dp2-s3")
    m = record["metrics"]
    assert record["status"] == "ok" and record["train"]["early_stopped"] and record["train"]["steps_done"] <= 1000
    assert m["seq_acc@32"] >= 0.99 and m["token_acc@64"] >= 0.98 and m["seq_acc@64"] >= 0.85, m
    assert m["params"] == 59_856
    for png in ("accuracy.png", "training.png"):
        assert is_png(cwd / "runs/dp2-s3" / png)
    assert "deltaproduct-2 on s3: step 100/1500  loss " in out  # plain progress lines: the output is not a terminal


def trained_with_diagnostics(folder: str) -> Callable[[Path, str], None]:
    def check(cwd: Path, out: str) -> None:
        record = read_metrics(cwd, folder)
        assert record["status"] == "ok"
        assert {"q_geo", "max_factor_norm", "erank@0.0", "q_geo@0"} <= set(record["metrics"])
        for png in ("accuracy.png", "training.png", "diagnostics.png"):
            assert is_png(cwd / folder / png), png
    return check


def osdn_recall_steps(cwd: Path, out: str) -> None:
    record = read_metrics(cwd, "runs/train/osdn-mqar_twice-s0")
    assert record["task"]["num_kv_pairs"] == 4 and record["train"]["early_stop"] is None
    assert record["train"]["steps_done"] == record["train"]["steps"]  # --target 0: every step


def benched(cwd: Path, out: str) -> None:
    assert "tokens/s" in out and "not measured" in out and "peak memory: not measured on the CPU" in out


def dry_run(cwd: Path, out: str) -> None:
    assert "space: 3 fields, 13 points" in out and "token_acc@16" in out and "yes (trainer)" in out


def searched(cwd: Path, out: str) -> None:
    import optuna

    from archspec.search.pareto import read_run

    run = read_run(cwd / "runs/demo")
    assert sum(r.status in ("ok", "failed", "diverged") for r in run.records) == 2 and run.front
    assert "demo: front of" in out and "runs/demo" in out
    assert optuna.get_all_study_names(f"sqlite:///{cwd / 'runs/demo/study.db'}") == ["demo"]


def plotted(cwd: Path, out: str) -> None:
    assert is_png(cwd / "runs/demo/front.png") and "wrote runs/demo/front.png" in out


def resumed(cwd: Path, out: str) -> None:
    assert "demo: front of" in out  # complete already: nothing trained again


def compared(cwd: Path, out: str) -> None:
    data = json.loads(out)
    assert len(data["runs"]) == 2 and all("hypervolume" in r and "igd_plus" in r for r in data["runs"])


def experiment_table(folder: str, run: str) -> Callable[[Path, str], None]:
    def check(cwd: Path, out: str) -> None:
        table = (cwd / folder / "results.md").read_text()
        assert f"| {run} |" in table and "| ok |" in table
    return check


def python_compile(cwd: Path, out: str) -> None:
    pass  # the block asserts nothing itself; it ran without an error (checked by exec)


REDUCED_EXPERIMENT = ("--set seeds=[0] --set train.steps=4 --set task.options.eval_size=16 --quiet")
# After the demo search: the comparison needs a second run; a copy of the first stands in
# (the same front twice: the comparison must still work).
SECOND_RUN = "copy runs/demo to runs/demo2"

PLANS: dict[str, Plan] = {
    "scripts/run-demo.sh": Plan(skip="the demo search itself (3-4 minutes); its command runs below at two trials"),
    "scripts/run-tests.sh": Plan(skip="this test suite"),
    "source .venv/bin/activate": Plan(skip="shell set-up"),
    "archspec validate 'specs/models/*.yaml'": Plan(validated_models),
    "archspec validate specs/search/demo.yaml specs/experiments/deltaproduct-s3.yaml": Plan(validated_kinds),
    "archspec compile specs/models/gated-deltaproduct-2.yaml": Plan(compiled("gated-deltaproduct-2", {})),
    "archspec compile specs/models/osdn.yaml --set mixer.heads=8": Plan(compiled("osdn", {"mixer.heads": 8})),
    'import archspec\nmodel = archspec.compile("specs/models/deltaproduct-2.yaml", **{"mixer.transition.n_h": 3})':
        Plan(python_compile),
    "archspec train specs/models/deltaproduct-2.yaml --task s3 --out runs/dp2-s3 --set model.layers=1 --set model.d_model=64 "
    "--set mixer.heads=4 --set mixer.head_dim=16 --set mixer.short_conv=0": Plan(dp2_learns_s3),
    "archspec train specs/models/osdn.yaml --task mqar_twice --diagnostics --out runs/osdn --set model.d_model=64 "
    "--set mixer.heads=2 --set mixer.head_dim=32": Plan(trained_with_diagnostics("runs/osdn"), replace=(("--diagnostics", "--diagnostics --steps 20"),)),
    "archspec bench specs/models/gated-deltanet.yaml": Plan(benched, replace=(("gated-deltanet.yaml", "gated-deltanet.yaml --batch 2 --seq-len 64 --warmup 1 --steps 1"),)),
    "archspec search specs/search/demo.yaml --dry-run": Plan(dry_run),
    "archspec search specs/search/demo.yaml --out runs/demo": Plan(searched, replace=(("runs/demo", "runs/demo --trials 2 --set budget.steps=10 --no-live"),)),
    "archspec pareto runs/demo --plot runs/demo/front.png": Plan(plotted),
    "archspec search --resume --out runs/demo": Plan(resumed),
    "archspec search specs/search/demo.yaml --out runs/demo2 --set seed=1": Plan(skip=SECOND_RUN),
    "archspec search specs/search/demo.yaml --out runs/demo2 --set seed=1 --trials 12": Plan(skip=SECOND_RUN),
    "archspec pareto runs/demo runs/demo2 --json": Plan(compared),
    "from archspec.search.space import load_search_spec\nfrom archspec.search.runner import run_search\n"
    "from archspec.search.pareto import read_run\n\n"
    'outcome = run_search(load_search_spec("specs/search/demo.yaml", ["budget.trials=4"]), "runs/demo")\n'
    'print([t.number for t in read_run("runs/demo").front])':
        Plan(skip="the demo search through the Python API; the command above runs it, tests/search/test_runner.py run_search"),
    "archspec train specs/models/deltaproduct-2.yaml --task s3 --out runs/dp2-s3 --set model.layers=1 --set model.d_model=64 "
    "--set mixer.heads=4 --set mixer.head_dim=16 --set mixer.short_conv=0 --diagnostics":
        Plan(trained_with_diagnostics("runs/dp2-s3"), replace=(("--diagnostics", "--diagnostics --steps 20"),)),
    "archspec train specs/models/osdn.yaml --task mqar_twice --task-option num_kv_pairs=4 --steps 500 --set model.d_model=64 "
    "--set mixer.heads=2 --set mixer.head_dim=32 --target 0": Plan(osdn_recall_steps, replace=(("--steps 500", "--steps 6"),)),
    "archspec bench specs/models/gated-deltaproduct-2.yaml --batch 8 --seq-len 512":
        Plan(benched, replace=(("--batch 8 --seq-len 512", "--batch 2 --seq-len 64 --warmup 1 --steps 1"),)),
    "archspec experiment specs/experiments/deltaproduct-s3.yaml --out runs/experiments/deltaproduct-s3":
        Plan(experiment_table("runs/experiments/deltaproduct-s3", "n_h=2, beta in [0,2]"),
             replace=(("runs/experiments/deltaproduct-s3", "runs/experiments/deltaproduct-s3 --only n_h-2-beta-in-0-2 "
                       + REDUCED_EXPERIMENT),)),
    "bash specs/experiments/run-gpu.sh": Plan(skip="needs a CUDA GPU"),
    "bash specs/experiments/run-gpu.sh deltaproduct-s4-nh-gpu": Plan(skip="needs a CUDA GPU"),
    "bash specs/experiments/run-gpu.sh deltaproduct-a5-ladder-gpu": Plan(skip="needs a CUDA GPU"),
    "bash specs/experiments/run-gpu.sh deltaproduct-a5-len16-gpu deltaproduct-a5-len32-gpu": Plan(skip="needs a CUDA GPU"),
    "bash specs/experiments/run-gpu.sh osdn-mqar-twice-512-gpu": Plan(skip="needs a CUDA GPU"),
    # its --smoke runs in tests/benchmarks/test_search_gpu_bench.py
    "python benchmarks/search_gpu.py --budget-s 540": Plan(skip="needs a CUDA GPU"),
    "python benchmarks/decode.py --budget-s 540": Plan(skip="needs a CUDA GPU"),
    "archspec search specs/search/gpu-space.yaml --out runs/gpu-space": Plan(skip="needs a CUDA GPU"),
    # The README's kernel performance section: timings on an H200 (tests/benchmarks/ runs the
    # scripts' CPU paths).
    "python benchmarks/kernel_times.py --budget-s 420": Plan(skip="needs a CUDA GPU"),
    "python benchmarks/kernel_times.py --against DIR --fla none": Plan(skip="needs a CUDA GPU"),
    "python benchmarks/gpu_check.py --budget-s 300": Plan(skip="needs a CUDA GPU"),
    # its --smoke runs in tests/benchmarks/test_short_conv_bench.py
    "python benchmarks/short_conv.py --against DIR": Plan(skip="needs a CUDA GPU"),
    # its --smoke runs in tests/benchmarks/test_loss_bench.py
    "python benchmarks/loss.py --against DIR --launch block_v=4096,num_warps=8": Plan(skip="needs a CUDA GPU"),
    # The README's several-GPU section: a Ray head over the GPUs of one host (its placement
    # and data-parallel trials are tested on declared GPUs in tests/search/test_placement.py,
    # the scaling script's --smoke in tests/benchmarks/test_search_scaling.py).
    "ray start --head --port 6379 --num-gpus 8": Plan(skip="needs a host with several GPUs"),
    "archspec search specs/search/full-gpu.yaml --out runs/full --address 127.0.0.1:6379": Plan(skip="needs a host with several GPUs"),
    "ray stop": Plan(skip="stops the cluster of the two commands above"),
    "python benchmarks/search_scaling.py --budget-s 3000": Plan(skip="needs a host with several GPUs"),
    "python benchmarks/search_scaling.py --gpus 2 --skip search": Plan(skip="needs a host with several GPUs"),
    "archspec experiment specs/experiments/osdn-mqar-twice.yaml --out runs/experiments/osdn-mqar-twice":
        Plan(experiment_table("runs/experiments/osdn-mqar-twice", "OSDN"),
             replace=(("runs/experiments/osdn-mqar-twice", "runs/experiments/osdn-mqar-twice --only OSDN " + REDUCED_EXPERIMENT),)),
    "archspec experiment specs/experiments/osdn-mqar-twice-128.yaml --out runs/experiments/osdn-mqar-twice-128":
        Plan(experiment_table("runs/experiments/osdn-mqar-twice-128", "OSDN"),
             replace=(("runs/experiments/osdn-mqar-twice-128", "runs/experiments/osdn-mqar-twice-128 --only OSDN " + REDUCED_EXPERIMENT),)),
    'import archspec\nspec = archspec.load_spec("specs/models/osdn.yaml", ["mixer.heads=8"])\nplan = archspec.lower(spec)\n'
    'model = archspec.compile("specs/models/osdn.yaml", mixer__heads=8)          # or\n'
    'model = archspec.compile("specs/models/osdn.yaml", **{"mixer.heads": 8})': Plan(python_compile),
}


def test_every_example_has_a_plan():
    examples = {example for _, example in doc_examples()}
    missing = sorted(examples - set(PLANS))
    stale = sorted(set(PLANS) - examples)
    assert not missing, f"examples in the docs that no plan covers (add one to PLANS): {missing}"
    assert not stale, f"plans for examples no longer in the docs: {stale}"


def _run(example: str, plan: Plan, cwd: Path, capsys) -> str:
    from archspec.search.cli import main

    text = example
    for old, new in plan.replace:
        assert old in text, (old, example)
        text = text.replace(old, new, 1)
    if text.startswith("archspec "):
        argv = []
        for word in shlex.split(text)[1:]:
            argv += sorted(glob.glob(word)) if "*" in word else [word]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{text}\n{out}\n{err}"
        assert "Traceback" not in out + err
        return out
    exec(compile(text, "<example>", "exec"), {})  # a Python block
    return capsys.readouterr().out


def test_the_examples_do_what_their_text_says(tmp_path, capsys, monkeypatch):
    (tmp_path / "specs").symlink_to(REPO / "specs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")  # rich output as wide as a terminal would give it
    ran = []
    for doc, example in doc_examples():
        if example in ran:
            continue  # the same command in two files runs once
        plan = PLANS[example]
        if plan.skip:
            if plan.skip == SECOND_RUN and not (tmp_path / "runs/demo2").exists():
                shutil.copytree(tmp_path / "runs/demo", tmp_path / "runs/demo2")
            continue
        out = _run(example, plan, tmp_path, capsys)
        plan.check(tmp_path, out)
        ran.append(example)
    assert len(ran) >= 20
    assert os.path.isdir(tmp_path / "runs")
