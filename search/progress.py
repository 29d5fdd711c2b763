"""How a training run shows its progress: a bar on a terminal, plain lines elsewhere.

A rich progress bar redraws one line in place, which only a terminal can show: written
to a file (`tee`, `nohup`, a CI or cluster-job log) it stays silent until the end. So
when the console is not a terminal the trainer prints one plain line per validation
(and at least one every `LINE_EVERY_S` seconds between them), as `archspec search
--no-live` prints one line per finished trial.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from rich.console import Console

# Between two validations a long run still says that it is alive this often (seconds).
LINE_EVERY_S = 30.0


class TrainingProgress(Protocol):
    """What the training loop tells its progress display."""

    def __enter__(self) -> TrainingProgress: ...
    def __exit__(self, *exc: Any) -> None: ...
    def stepped(self, step: int, loss: float) -> None: ...
    def validated(self, step: int, loss: float, metrics: Mapping[str, float], watched: str | None) -> None: ...


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def stepped(self, step: int, loss: float) -> None:
        pass

    def validated(self, step: int, loss: float, metrics: Mapping[str, float], watched: str | None) -> None:
        pass


class _Bar:
    """A rich progress bar named `label`: steps, loss, the watched validation metric, times."""

    def __init__(self, label: str, total: int, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.bar = self.progress.add_task(label, total=total, loss="-", note="")

    def __enter__(self) -> _Bar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def stepped(self, step: int, loss: float) -> None:
        self.progress.update(self.bar, completed=step, loss=f"{loss:.4f}")

    def validated(self, step: int, loss: float, metrics: Mapping[str, float], watched: str | None) -> None:
        if watched is not None and watched in metrics:
            self.progress.update(self.bar, note=f"{watched} {metrics[watched]:.3f}")


class _Lines:
    """One plain line per validation, and one every `LINE_EVERY_S` seconds in between."""

    def __init__(self, label: str, total: int, console: Console, every_s: float = LINE_EVERY_S):
        self.label, self.total, self.console, self.every_s = label, total, console, every_s
        self.started = self.last_line = time.perf_counter()

    def _print(self, text: str) -> None:
        self.last_line = time.perf_counter()
        elapsed = self.last_line - self.started
        self.console.print(f"{self.label}: {text}  [{elapsed:.0f} s]", markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()

    def __enter__(self) -> _Lines:
        self._print(f"training, {self.total} steps")
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def stepped(self, step: int, loss: float) -> None:
        if time.perf_counter() - self.last_line >= self.every_s:
            self._print(f"step {step}/{self.total}  loss {loss:.4f}")

    def validated(self, step: int, loss: float, metrics: Mapping[str, float], watched: str | None) -> None:
        shown = [watched] if watched in metrics else list(metrics)[:2]
        values = "  ".join(f"{name} {metrics[name]:.3f}" for name in shown)
        self._print(f"step {step}/{self.total}  loss {loss:.4f}  {values}".rstrip())


def training_progress(label: str, total: int, *, quiet: bool, console: Console | None = None) -> TrainingProgress:
    """Nothing when `quiet`; a bar on a terminal; plain lines on anything else."""
    if quiet:
        return _Silent()
    console = console or Console()
    return _Bar(label, total, console) if console.is_terminal else _Lines(label, total, console)
