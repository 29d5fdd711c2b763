"""A training function for placement tests: it trains nothing and reports where it ran.

Every trial of a search writes a file into the run directory's `rendezvous/` and waits
until as many trials as the budget holds have done so: the trials finish only if Ray ran
them all at once (else the first ones give up after `WAIT_S` and report how many they
met). In a data-parallel trial every rank reports too, through the process group.
Metrics (numbers, as a trial reports them): `token_acc@16` and `params` (cheap.py's),
`met` (trials seen at the rendezvous), `ranks`, `rank_sum` (the sum of 1..ranks over
the process group), `ranks_nvls_off` and `ranks_visible_gpus` (the least over the ranks
of NCCL_NVLS_ENABLE == "0" and of the GPU ids in CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tests.search.cheap import CheapResult, meet, quality

WAIT_S = 40.0


def _rendezvous(run: Path, number: str) -> int:
    expected = int(yaml.safe_load((run / "search.yaml").read_text())["budget"]["trials"])
    return meet(run / "rendezvous", number, expected, WAIT_S)


def probe_train(spec, task, *, steps, seed, device, out_dir=None, data_parallel=None, **options):
    from archspec.cost import estimate
    from archspec.search.placement import visible_devices

    metrics = {"token_acc@16": quality(spec), "params": float(estimate(spec).params), "ranks": 1.0, "rank_sum": 1.0,
               "ranks_nvls_off": float(os.environ.get("NCCL_NVLS_ENABLE") == "0"),
               "ranks_visible_gpus": float(len(visible_devices()))}
    if data_parallel is not None:
        import torch
        import torch.distributed as dist

        values = torch.tensor([data_parallel.rank + 1.0, metrics["ranks_nvls_off"], metrics["ranks_visible_gpus"]])
        total = values.clone()
        dist.all_reduce(total)
        least = values.clone()
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        metrics.update(ranks=float(data_parallel.world_size), rank_sum=float(total[0]),
                       ranks_nvls_off=float(least[1]), ranks_visible_gpus=float(least[2]))
    if out_dir is not None:  # rank 0 only, in a data-parallel trial: out_dir is run/trials/NNNNN/task
        trial = Path(out_dir).parent
        metrics["met"] = float(_rendezvous(trial.parents[1], trial.name))
    return CheapResult("ok", metrics)
