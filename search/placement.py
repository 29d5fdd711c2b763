"""Where a trial runs: the environment every trial carries, the device it trains on, and
what its record says about both.

Ray places a trial that reserves GPUs by setting `CUDA_VISIBLE_DEVICES` in its worker to
the ids it assigned (`ray.get_gpu_ids()`): the trial then sees exactly those GPUs, as
`cuda:0` (and `cuda:1`, ... when it reserved several), and a fractional trial sees the
one GPU it shares. So the trial never picks a GPU itself: it trains on `cuda:0`, which is
the GPU Ray gave it, and checks that what it sees is what Ray assigned.

NCCL is left at its defaults except NVLink multicast (NVLS), which stays off on the GPU
machines this project runs on: `NCCL_NVLS_ENABLE=0` is in every trial's environment,
set for the whole Ray job (`ray.init(runtime_env=...)`, Ray's public runtime
environment), so that every worker a search starts, on every node, carries it from its
first line, and the processes a data-parallel trial starts inherit it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# The variables every trial's process (and the processes it starts) runs with.
TRIAL_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0"}


def ray_runtime_env() -> dict[str, Any]:
    """The runtime environment of a search's Ray job: `TRIAL_ENV` in every worker."""
    return {"env_vars": dict(TRIAL_ENV)}


def trial_device(uses_gpu: bool, cuda_devices: int) -> str:
    """The device a trial trains on: `cuda:0` when it reserved a GPU and CUDA shows one
    (the first of those Ray made visible), else `cpu`. A GPU that Ray only declares
    (`ray start --num-gpus N` on a machine without CUDA, as in the tests) trains on the CPU."""
    return "cuda:0" if uses_gpu and cuda_devices > 0 else "cpu"


def visible_devices(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids in `CUDA_VISIBLE_DEVICES` (empty when it is unset or empty)."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return [part.strip() for part in value.split(",") if part.strip()] if value else []


def placement_problem(gpu_ids: list[str], env: Mapping[str, str] | None = None) -> str | None:
    """Why the trial's environment does not match the GPUs Ray assigned it, or None.

    A trial that trained on another GPU than the one Ray reserved for it would share it
    with another trial unknown to the scheduler; this catches it before training."""
    env = os.environ if env is None else env
    if gpu_ids and visible_devices(env) != [str(g) for g in gpu_ids]:
        return (f"Ray assigned GPU(s) {','.join(map(str, gpu_ids))} but CUDA_VISIBLE_DEVICES is "
                f"{env.get('CUDA_VISIBLE_DEVICES')!r}: the trial would not train on the GPU reserved for it")
    wrong = {k: env.get(k) for k, v in TRIAL_ENV.items() if env.get(k) != v}
    if wrong:
        return f"the trial's environment lacks {', '.join(f'{k}={TRIAL_ENV[k]}' for k in wrong)} (it has {wrong})"
    return None


def trial_placement(gpu_ids: list[Any], **ray_context: Any) -> dict[str, Any]:
    """What a trial's record says about where it ran: Ray's node and cluster, the GPU ids
    Ray assigned, and the environment the trial saw (`CUDA_VISIBLE_DEVICES` and
    `TRIAL_ENV`'s variables), so that a run directory shows each trial's placement."""
    env = os.environ
    return {**ray_context, "gpu_ids": [str(g) for g in gpu_ids],
            "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
            **{k.lower(): env.get(k) for k in TRIAL_ENV}}
