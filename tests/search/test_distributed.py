"""Data-parallel trials (`search/distributed.py`) on the CPU over gloo: two ranks train as
one process does at the same global batch (losses and weights), with a task whose rows
score different numbers of tokens so that the loss weighting matters; a failing rank
and a batch too small to split are reported; resources that cannot run DDP are refused
at the field. Imports no Ray.

Each run starts its ranks as fresh Python processes (a few seconds on 2 cores)."""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from archspec.blocks.loss import IGNORE_INDEX, masked_labels
from archspec.errors import ArchspecError
from archspec.search.distributed import DataParallel, RankFailed, train_data_parallel, world_size
from archspec.search.space import load_search_spec
from archspec.search.tasks.base import Batch
from archspec.search.tasks.groups import GroupWordProblem
from archspec.search.trainer import train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "specs" / "search" / "bases" / "tiny-deltanet.yaml"


@pytest.fixture(autouse=True)
def ranks_import_the_tests(monkeypatch):
    """The ranks unpickle this module's task and functions: they must find `tests`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


@dataclass
class RaggedS3(GroupWordProblem):
    """S3 whose row i scores only its last (i % 4 + 1) * 2 positions: rows score unequal
    numbers of tokens, so the mean over a rank's rows is not its share of the global mean."""

    def train_batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        batch = super().train_batch(batch_size, generator)
        keep = torch.zeros_like(batch.mask, dtype=torch.bool)
        for row in range(batch_size):
            keep[row, -(row % 4 + 1) * 2:] = True
        return Batch(batch.inputs, batch.targets, batch.mask.bool() & keep)


def ragged_task() -> RaggedS3:
    from archspec.search.tasks import get_task

    task = RaggedS3(group_name="s3", train_len=8, eval_size=32, eval_factors=(1,))
    task.preset = get_task("s3").preset  # a registry task carries its preset: train() reads it
    return task


ROWS_SEEN: list[int] = []  # in a rank's process: the rows of each step's shard


@dataclass(frozen=True)
class CountingDataParallel(DataParallel):
    def shard(self, inputs, labels):
        inputs, labels, weight = super().shard(inputs, labels)
        ROWS_SEEN.append(int(inputs.shape[0]))
        return inputs, labels, weight


def train_float64(spec, task, *, data_parallel=None, **options):
    """The trainer in float64 (so that the order of a sum moves the numbers by ~1e-16, not
    ~1e-7, which AdamW's normalised steps would blow up where a gradient is near zero),
    with a rank that records the rows it trains on."""
    if data_parallel is not None:
        data_parallel = CountingDataParallel(data_parallel.rank, data_parallel.world_size, data_parallel.device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        result = train(spec, task, data_parallel=data_parallel, **options)
    finally:
        torch.set_default_dtype(previous)
    result.record["rows_seen"] = list(ROWS_SEEN)
    return result


def test_two_gloo_ranks_train_as_one_process_at_the_same_global_batch(tmp_path):
    task = ragged_task()
    # The weighting is exercised: rank 0's rows (0..2 of 6) score 2+4+6 tokens, rank 1's 8+2+4.
    labels = masked_labels(*task.train_batch(6, torch.Generator().manual_seed(0))[1:])
    scored = (labels != IGNORE_INDEX).sum(1).tolist()
    assert sum(scored[:3]) != sum(scored[3:])
    options = dict(steps=5, seed=3, quiet=True, batch_size=6, lr=2e-2, warmup_steps=0, eval_every=5, target=0,
                   measure_throughput=False)
    one = train_float64(TINY, task, device="cpu", out_dir=tmp_path / "one", **options)
    two = train_data_parallel(train_float64, TINY, task, dict(options, device="cpu", out_dir=str(tmp_path / "two")), 2,
                              cuda=False)
    assert one.status == two.status == "ok", (one.reason, two.reason)
    assert two.record["rows_seen"] == [3] * 5  # rank 0 trained on half of every global batch
    losses_one = [h["loss"] for h in one.record["history"]]
    losses_two = [h["loss"] for h in two.record["history"]]
    assert len(losses_one) == len(losses_two) == 5
    assert losses_two == pytest.approx(losses_one, rel=1e-8, abs=0)

    from safetensors.torch import load_file

    from archspec.search.trainer import build_model_for_task

    torch.manual_seed(3)
    start = build_model_for_task(TINY, task).model.double().state_dict()
    w_one, w_two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert w_one.keys() == w_two.keys()
    assert max(float((w_one[k] - start[k]).abs().max()) for k in w_one) > 1e-2  # training moved the weights...
    assert max(float((w_one[k] - w_two[k]).abs().max()) for k in w_one) < 1e-6  # ...the same way in both (1e-4 of it)
    assert w_one["embed.weight"].dtype == torch.float64
    written = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert written["train"]["data_parallel"] == 2 and one.record["train"]["data_parallel"] == 1
    assert not (tmp_path / "two" / "resume.pt").exists()  # rank 0 alone wrote, and finished


def test_the_ranks_share_the_rows_and_their_weights_make_the_global_mean():
    ranks = [DataParallel(r, 3, "cpu") for r in range(3)]
    assert [(s.start, s.stop) for s in (dp.rows(7) for dp in ranks)] == [(0, 3), (3, 5), (5, 7)]
    inputs = torch.arange(14).reshape(7, 2)
    labels = torch.tensor([[1, IGNORE_INDEX], [1, 1], [1, 1], [IGNORE_INDEX, IGNORE_INDEX], [1, 1], [1, 1], [1, 1]])
    weights = [dp.shard(inputs, labels)[2] for dp in ranks]
    assert weights == pytest.approx([5 * 3 / 11, 2 * 3 / 11, 4 * 3 / 11])  # scored tokens each x ranks / all scored
    assert torch.equal(ranks[1].shard(inputs, labels)[0], inputs[3:5])
    with pytest.raises(ArchspecError, match="a batch of 2 rows cannot be split over 3"):
        ranks[0].rows(2)


def fails_in_rank_one(spec, task, *, data_parallel, **options):
    import torch.distributed as dist

    if data_parallel.rank == 1:
        raise RuntimeError("rank one was told to fail")
    dist.barrier()  # rank 0 waits for a rank that is gone: the launcher must stop it


def test_a_failing_rank_ends_the_trial_with_its_error_and_a_refusal_is_raised_as_one(tmp_path):
    with pytest.raises(RankFailed, match="rank 1 of 2 exited with code 1:.*rank one was told to fail"):
        train_data_parallel(fails_in_rank_one, TINY, "s3", {}, 2, cuda=False)
    with pytest.raises(ArchspecError, match="a batch of 1 rows cannot be split over 2"):
        train_data_parallel(train, TINY, "s3", dict(steps=1, batch_size=1, quiet=True), 2, cuda=False)


SEARCH = """\
name: dp
base: {base}
space:
  mixer.transition.n_h: {{choices: [1, 2]}}
task: s3
objectives: [{{token_acc@64: max}}]
budget: {{trials: 1, steps: 1}}
resources: {resources}
"""


@pytest.mark.parametrize("resources, field, message", [
    ("{gpu: 1.5}", "resources.gpu", "1.5 GPUs: a trial takes a fraction of one GPU (above 0, below 1"),
    ("{gpu: 0.5, data_parallel: 2}", "resources.data_parallel", "data-parallel trials take whole GPUs, one per process: set gpu: 2"),
    ("{gpu: 1, data_parallel: 2}", "resources.data_parallel", "(gpu: 1 is one GPU)"),
    ("{gpu: 2, data_parallel: 4}", "resources.data_parallel", "with gpu: 2 the trial runs one process per GPU"),
    ("{cpu: 1, data_parallel: 2}", "resources.data_parallel", "2 CPU processes need a CPU each: set cpu: 2"),
])
def test_resources_that_cannot_run_data_parallel_are_refused_at_the_field(tmp_path, resources, field, message):
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(SEARCH.format(base=TINY, resources=resources)))
    with pytest.raises(ArchspecError) as caught:
        load_search_spec(path)
    [(where, at, said)] = caught.value.problems
    assert at == field and message in said and where.file == str(path) and where.line == 8


@pytest.mark.parametrize("resources, processes", [
    ("{gpu: 0.5}", 1), ("{gpu: 1}", 1), ("{gpu: 4}", 4), ("{gpu: 2, data_parallel: 2}", 2), ("{cpu: 3, data_parallel: 3}", 3),
])
def test_the_processes_of_a_trial(tmp_path, resources, processes):
    path = tmp_path / "search.yaml"
    path.write_text(SEARCH.format(base=TINY, resources=resources))
    assert world_size(load_search_spec(path).spec.resources) == processes
