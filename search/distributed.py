"""Data-parallel trials: one model trained by several processes with DistributedDataParallel.

A search spec asks for it with `resources.gpu: N` (a whole number >= 2: one process per
GPU, NCCL), or, without GPUs, with `resources.data_parallel: N` (N CPU processes, gloo:
how the tests run it on a machine without CUDA). The trial's Ray worker then starts N
processes (`python -m archspec.search.distributed`), each of which calls the same
training function (`archspec.search.trainer.train`) with a `DataParallel` for its rank;
the trainer's own loop and training step run in every process, and only these seams
differ (`search/trainer.py`):

- every rank draws the same global batch (the same seed, the same data generator) and
  trains on its share of the rows (`DataParallel.shard`), so the global batch is the
  spec's batch, split across ranks;
- each rank's loss is weighted by its share of the scored tokens, so that the gradients
  DDP averages are those of the global batch's mean loss (a mask may score a different
  number of tokens in each rank's rows); the loss each rank records is the global one;
- a stop that depends on the clock or on an evaluation is agreed by all ranks
  (`DataParallel.any`), so that no rank leaves the loop while the others wait for it;
- rank 0 alone writes the trial's outputs; its result is the trial's.

With the same seed and global batch the loss curve and the weights are those of one
process at that batch, up to the order of floating-point sums (tests/search/test_distributed.py).

Why processes of our own and not Ray Train's `TorchTrainer`: a Tune trial here is a
function trainable driven by the project's Optuna searcher, reporting once; a
`TorchTrainer` inside it would be a second Ray job level (placement groups per trial,
its own checkpoint and reporting protocol) around a loop that already exists. Starting
the ranks inside the trial keeps one trainable, one record, one reporting path, and the
trial's GPUs are exactly those Ray reserved for it (`CUDA_VISIBLE_DEVICES`, inherited by
the ranks: rank r trains on `cuda:r`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archspec.errors import ArchspecError

# How long a collective may wait for a rank before the process group gives up (a rank
# that died leaves the others waiting; the launcher stops them sooner when it notices).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
PAYLOAD_FILE, RESULT_FILE, STORE_FILE = "payload.pkl", "result.pkl", "store"
STDERR_TAIL_LINES = 25


# --------------------------------------------------------------------------- the spec's side


def gpu_problem(gpu: float | str) -> str | None:
    """Why `resources.gpu` is not a share Ray can give a trial, or None (`auto` is a share
    of one GPU, sized per trial)."""
    if isinstance(gpu, (int, float)) and gpu > 1 and gpu != int(gpu):
        return (f"{gpu:g} GPUs: a trial takes a fraction of one GPU (above 0, below 1: trials share it) or whole GPUs "
                "(1, 2, ...: with 2 or more it trains one model on them with DistributedDataParallel)")
    return None


def data_parallel_problem(gpu: float | str, cpu: float, data_parallel: int | None) -> str | None:
    """Why `resources.data_parallel` cannot run with these `gpu` and `cpu`, or None."""
    if isinstance(gpu, str):  # `auto`: a share of one GPU
        if data_parallel is None or data_parallel == 1:
            return None
        return (f"data-parallel trials take whole GPUs, one per process: set gpu: {data_parallel} "
                f"(gpu: {gpu} is a share of one GPU), or gpu: 0 for CPU processes")
    if data_parallel is None or (data_parallel == 1 and gpu < 2):
        return None
    if gpu >= 2 and data_parallel != gpu:
        return (f"with gpu: {gpu:g} the trial runs one process per GPU; data_parallel: {data_parallel} "
                f"must be {gpu:g} or left out")
    if 0 < gpu < 2:
        return (f"data-parallel trials take whole GPUs, one per process: set gpu: {data_parallel} "
                f"(gpu: {gpu:g} is {'a share of one GPU' if gpu < 1 else 'one GPU'}), or gpu: 0 for CPU processes")
    if gpu == 0 and cpu < data_parallel:
        return f"{data_parallel} CPU processes need a CPU each: set cpu: {data_parallel} or more (it is {cpu:g})"
    return None


def world_size(resources: Any) -> int:
    """Processes that train one trial's model: `gpu` when it is 2 or more, else
    `data_parallel` (CPU processes), else 1."""
    if isinstance(resources.gpu, (int, float)) and resources.gpu >= 2:
        return int(resources.gpu)
    return int(getattr(resources, "data_parallel", None) or 1)


# --------------------------------------------------------------------------- one rank's seams


@dataclass(frozen=True)
class DataParallel:
    """What the trainer's loop needs to know and do as one rank of a data-parallel trial."""

    rank: int
    world_size: int
    device: str  # this rank's device: collectives on NCCL need their tensors there

    @property
    def main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: Any) -> Any:
        """`model` (already on this rank's device) in DistributedDataParallel: its
        backward averages the gradients over the ranks. The weights are broadcast from
        rank 0, though every rank built the same ones from the same seed."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        device = torch.device(self.device)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def rows(self, batch: int) -> slice:
        """This rank's rows of a global batch of `batch` rows: contiguous, the first
        `batch % world_size` ranks one row more (as `torch.tensor_split`)."""
        if batch < self.world_size:
            raise ArchspecError(f"a batch of {batch} rows cannot be split over {self.world_size} data-parallel processes",
                                [(None, "train.batch_size", f"use at least {self.world_size} rows (ideally a multiple)")])
        base, extra = divmod(batch, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def shard(self, inputs: Any, labels: Any) -> tuple[Any, Any, float]:
        """This rank's rows of the global batch and the weight of its loss: the mean over
        its scored tokens times `weight` is its share of the global mean, so that DDP's
        average of the ranks' gradients is the gradient of the global batch's loss."""
        from archspec.blocks.loss import IGNORE_INDEX

        rows = self.rows(inputs.shape[0])
        scored = labels != IGNORE_INDEX
        total, local = int(scored.sum()), int(scored[rows].sum())
        # A rank without a scored token (a mask that scores few rows) gives a NaN mean;
        # the tasks score every row, and the divergence check would say so.
        weight = local * self.world_size / total if total else 1.0
        return inputs[rows], labels[rows], weight

    def average(self, value: Any) -> Any:
        """The mean of a tensor over the ranks (gloo has no AVG: a sum, divided)."""
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total)
        return total / self.world_size

    def total(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def any(self, flag: bool) -> bool:
        """Whether any rank says so: a stop every rank takes together."""
        return self.total(1.0 if flag else 0.0) > 0


# --------------------------------------------------------------------------- the launcher


class RankFailed(RuntimeError):
    """A rank of a data-parallel trial exited with an error (its stderr's tail in the message)."""


def train_data_parallel(train_fn: Any, spec: Any, task: Any, kwargs: dict[str, Any], processes: int, *,
                        cuda: bool, threads: int = 1) -> Any:
    """Run `train_fn(spec, task, **kwargs, data_parallel=...)` in `processes` ranks and
    return rank 0's result. `cuda`: rank r trains on `cuda:r` over NCCL, else on the CPU
    over gloo with `threads` torch threads each. One process trains without DDP (and
    without `data_parallel`), in a fresh process all the same: a baseline that starts as
    the ranks do. `train_fn` must be importable by the ranks (the stock trainer is); an
    `ArchspecError` raised in a rank is raised here."""
    if cuda:
        import torch

        if torch.cuda.device_count() < processes:
            raise ArchspecError(
                f"a data-parallel trial of {processes} processes sees {torch.cuda.device_count()} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
                [(None, "resources.gpu", "each process needs a GPU of its own")])
    from archspec.search.placement import TRIAL_ENV

    with tempfile.TemporaryDirectory(prefix="archspec-ddp-") as tmp:
        folder = Path(tmp)
        payload = dict(train_fn=train_fn, spec=spec, task=task, kwargs=kwargs, world_size=processes, cuda=cuda,
                       threads=max(1, threads), parent=os.getpid())
        (folder / PAYLOAD_FILE).write_bytes(pickle.dumps(payload))
        env = {**os.environ, **TRIAL_ENV}
        ranks = []
        for rank in range(processes):
            err = open(folder / f"rank{rank}.err", "wb")  # noqa: SIM115 (closed below)
            ranks.append((subprocess.Popen([sys.executable, "-m", "archspec.search.distributed", str(folder), str(rank)],
                                           env=env, stdout=subprocess.DEVNULL, stderr=err), err))
        try:
            failed = _wait(ranks)
        finally:
            for proc, err in ranks:
                _stop(proc)
                err.close()
        result_file = folder / RESULT_FILE
        outcome = pickle.loads(result_file.read_bytes()) if result_file.exists() else None
        if outcome is not None and outcome[0] == "refused":
            raise outcome[1]
        if failed is not None:
            rank, code = failed
            raise _rank_failed(rank, processes, code, (folder / f"rank{rank}.err").read_text(errors="replace"))
        if outcome is None:
            raise RankFailed("data-parallel rank 0 ended without a result")
        return outcome[1]


def _rank_failed(rank: int, processes: int, code: int, stderr: str) -> RankFailed:
    """The error of a failed rank: its last line (the exception, as the trial's reason) in
    the message, the tail of its stderr as a note (in the trial's error.txt)."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "(nothing on its stderr)"
    error = RankFailed(f"data-parallel rank {rank} of {processes} exited with code {code}: {last}")
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"stderr of rank {rank} (last {STDERR_TAIL_LINES} lines):\n" + "\n".join(lines[-STDERR_TAIL_LINES:]))
    return error


def _wait(ranks: list[tuple[subprocess.Popen, Any]]) -> tuple[int, int] | None:
    """Wait for every rank; at the first that fails, return (rank, exit code) at once (the
    others would wait for it in their next collective)."""
    while True:
        codes = [proc.poll() for proc, _ in ranks]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return rank, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_with_parent(parent: int) -> None:
    """A rank whose trial's worker died (Ray stops a trial by killing its worker) ends
    too, rather than train on for nobody."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _run_rank(folder: Path, rank: int) -> None:
    import torch
    import torch.distributed as dist

    payload = pickle.loads((folder / PAYLOAD_FILE).read_bytes())
    _exit_with_parent(payload["parent"])
    world, cuda = payload["world_size"], payload["cuda"]
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(payload["threads"])
    device = f"cuda:{rank}" if cuda else "cpu"
    kwargs = dict(payload["kwargs"], device=device)
    if world > 1:
        # NCCL binds to this rank's GPU at once (device_id): no guessing of the device later
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder / STORE_FILE}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT,
                                device_id=torch.device(device) if cuda else None)
        kwargs["data_parallel"] = DataParallel(rank, world, device)
    if rank:  # rank 0 writes the trial's outputs and shows progress
        kwargs.update(out_dir=None, quiet=True)
    try:
        outcome: tuple[str, Any] = ("ok", payload["train_fn"](payload["spec"], payload["task"], **kwargs))
    except ArchspecError as exc:  # the same refusal in every rank: rank 0 hands it back
        outcome = ("refused", exc)
    if rank == 0:
        partial = folder / (RESULT_FILE + ".part")
        partial.write_bytes(pickle.dumps(outcome))
        os.replace(partial, folder / RESULT_FILE)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    _run_rank(Path(sys.argv[1]), int(sys.argv[2]))
    sys.exit(0)
