"""The peer's autotune picks, kept between runs.

flash-linear-attention's kernels autotune: on a cold machine, trying every config of every
kernel is most of a benchmark's first minutes (five designs of the whole-model benchmark
took 300 s to warm on the H200, fla's autotuning most of it). A run records what the
autotuners picked (`record`: each Triton autotuner's key -> config, as its own benchmark
chose them), and a later run on the same device, Triton and fla (`load`) pins those picks
(`pin`): the autotuners find them in their cache, compile that config alone and time
nothing. A process pins before it runs the peer (the warm-up's workers too). The peer then
runs at the settings its own autotuning chose, as it would in a warm process; a key the
file lacks is autotuned as usual.

The file (`FILE` in the results folder) holds the machine it was made on and is merged, not
replaced, by each run, so runs of different designs add up; a results folder without one
(`--out` somewhere new) starts from a copy of the committed file (`COMMITTED`) where that
holds this machine's picks. It names the designs whose
peer model ran to the end of a step when the picks were kept (`covered`): the warm-up
compiles a covered design's pinned configs in one job, and shares out the configs of a
design the picks do not cover (its kernels autotune as on a cold machine; one job
compiling every config of fla's RWKV-7 ran past 220 s on an H100 while the other designs
waited).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

FILE = "fla_autotune.json"
COMMITTED = Path(__file__).resolve().parent / "results"  # the picks kept in the repository
Picks = dict[str, list[list[Any]]]  # autotuner name -> [[key, config], ...]


def _name(tuner: Any) -> str:
    fn = tuner.base_fn
    return f"{fn.__module__}.{fn.__name__}"


def _autotuners() -> list[Any]:
    from triton.runtime.autotuner import Autotuner

    return [obj for obj in gc.get_objects() if issubclass(type(obj), Autotuner)]  # type(): no proxy's __class__


def _config(config: Any) -> dict[str, Any]:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}


def _as_data(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def current() -> Picks:
    """Every autotuner's picks in this process. Left out: configs with a pre-hook (a hook
    is code, not data) and keys or settings that are not plain data."""
    picks: Picks = {}
    for tuner in _autotuners():
        for key, config in tuner.cache.items():
            entry = [list(key), _config(config)]
            if getattr(config, "pre_hook", None) is None and _as_data(entry):
                picks.setdefault(_name(tuner), []).append(entry)
    return picks


def machine() -> dict[str, Any]:
    """What picks are valid for: the device and the versions that compile and tune."""
    import triton

    try:
        import fla

        fla_version = fla.__version__
    except ImportError:
        fla_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"device": device, "triton": triton.__version__, "fla": fla_version}


def load(path: Path) -> Picks | None:
    """The picks in `path` when they were made on this machine, else None."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return data["picks"] if data.get("machine") == machine() else None


def covered(path: Path) -> set[str]:
    """The designs whose peer model ran a whole step when `path`'s picks (of this machine)
    were kept: their kernels' keys are all there. None without picks of this machine."""
    if load(path) is None:
        return set()
    return set(json.loads(path.read_text()).get("designs", []))


def record(path: Path, designs: Iterable[str] = ()) -> int:
    """Merge this process's picks into `path` (atomically), and `designs` into the designs
    they cover; the number of keys written."""
    from archspec.atomic import write_text_atomic

    picks = load(path) or {}
    names = sorted(covered(path) | set(designs))
    for name, entries in current().items():
        known = {json.dumps(key) for key, _ in picks.get(name, [])}
        picks.setdefault(name, []).extend(e for e in entries if json.dumps(e[0]) not in known)
    write_text_atomic(path, json.dumps({"machine": machine(), "designs": names, "picks": picks}, indent=1,
                                       sort_keys=True))
    return sum(len(entries) for entries in picks.values())


def pin(picks: Picks) -> int:
    """Put each recorded pick into its autotuner's cache in this process; the number of
    keys pinned. fla is imported first, so that its kernels' autotuners exist. Nothing
    wraps the autotuners: the peer runs as it would with its cache already warm."""
    import triton

    try:
        import fla  # noqa: F401  (its layers and models import the kernels)
    except ImportError:
        pass
    pinned = 0
    for tuner in _autotuners():
        for key, config in picks.get(_name(tuner), []):
            tuner.cache.setdefault(tuple(key), triton.Config(dict(config["kwargs"]), num_warps=config["num_warps"],
                                                             num_stages=config["num_stages"], num_ctas=config["num_ctas"],
                                                             maxnreg=config["maxnreg"]))
            pinned += 1
    return pinned


def pin_from(folder: Path, log: Callable[[str], None] = print, committed: Path = COMMITTED) -> Picks | None:
    """The picks an earlier run left in `folder`, pinned in this process when they were
    made on this machine (else None: the peer autotunes afresh). A folder without picks of
    this machine (a fresh `--out`) starts from the committed ones where those are this
    machine's: its file becomes a copy of theirs, which this run's picks then join (fla's
    RWKV-7 alone took 515 s to autotune afresh on an H100)."""
    from archspec.atomic import write_text_atomic

    if load(folder / FILE) is None and folder.resolve() != committed.resolve() and load(committed / FILE) is not None:
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / FILE, (committed / FILE).read_text())
        log(f"{folder / FILE}: a copy of the committed picks ({committed / FILE})")
    pinned = load(folder / FILE)
    if pinned is None:
        log(f"fla autotunes afresh: no picks of this machine in {folder / FILE}")
        return None
    log(f"fla starts from {pin(pinned)} autotune picks of an earlier run ({folder / FILE})")
    return pinned


def keep(folder: Path, log: Callable[[str], None] = print, designs: Iterable[str] = ()) -> None:
    """This run's picks, merged into `folder`'s file for the next run, `designs` among those
    they cover (`covered`). The picks only save the next run time: failing to keep them is
    logged, never raised into the run."""
    try:
        log(f"{record(folder / FILE, designs)} autotune picks in {folder / FILE}")
    except Exception as exc:  # noqa: BLE001
        log(f"autotune picks not kept: {type(exc).__name__}: {exc}")
