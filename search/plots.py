"""PNG plots of a training run (matplotlib, Agg backend: no display needed).

- `accuracy.png`: each per-position curve of each evaluation split against the
  position, with the training length marked (the DeltaProduct paper's Fig. 5 layout).
- `training.png`: the training loss against the step (log scale) and each validation
  metric against the step, the curves that show whether and when a run learned.
- `diagnostics.png`: per layer, the effective rank of each head's state along the
  sequence, and the residual ratio `q_t` (log scale) with `q_geo` in the legend.

Each plot is written to a temporary file and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from archspec.atomic import write_atomic  # noqa: E402

from .diagnostics import DiagnosticsReport  # noqa: E402
from .tasks.base import Curve  # noqa: E402


def _save(fig: plt.Figure, path: str | os.PathLike[str]) -> Path:
    fig.tight_layout()  # keep axis labels of neighbouring panels apart
    write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return Path(path)


def _positions(values: list[float]) -> list[int]:
    return list(range(1, len(values) + 1))


def _finite(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def plot_accuracy(
    curves: dict[str, list[Curve]], train_len: int, path: str | os.PathLike[str], title: str = ""
) -> Path | None:
    """One panel per y-axis kind (accuracy, bits per byte); None when there is no curve."""
    kinds: dict[str, list[tuple[str, Curve]]] = {}
    for split, split_curves in curves.items():
        for curve in split_curves:
            kinds.setdefault(curve.ylabel, []).append((split, curve))
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.2), squeeze=False)
    for ax, (ylabel, entries) in zip(axes[0], kinds.items()):
        sparse = any(sum(1 for v in c.values if v is not None and not math.isnan(v)) < len(c.values) / 2 for _, c in entries)
        for split, curve in entries:
            label = curve.label if len(curves) == 1 else f"{split}: {curve.label}"
            values = _finite(curve.values)
            if curve.positions is not None:  # one point per split, e.g. per test length
                ax.plot(curve.positions, values, marker="o", label=label)
            elif sparse:  # e.g. recall: only query positions are scored
                ax.plot(_positions(values), values, marker=".", linestyle="none", label=label)
            else:
                ax.plot(_positions(values), values, label=label)
        ax.axvline(train_len, color="grey", linestyle="--", linewidth=1, label=f"training length {train_len}")
        by_length = all(c.positions is not None for _, c in entries)
        ax.set_xlabel("sequence length" if by_length else "position t")
        ax.set_ylabel(ylabel)
        if ylabel == "accuracy":
            # scaled accuracy can fall below 0 (worse than chance)
            ax.set_ylim(min([-0.02, *(v for _, c in entries for v in _finite(c.values) if not math.isnan(v))]), 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_training(
    history: list[dict[str, float]], evals: list[dict[str, float]], path: str | os.PathLike[str], title: str = "",
    watched: str | None = None,
) -> Path | None:
    """Left: training loss by step; right: validation metrics by step (the early-stop
    metric `watched` drawn bold). None when no step was recorded."""
    if not history:
        return None
    fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    ax_loss.plot(steps, losses, label="training loss")
    if all(v is not None and v > 0 for v in losses):
        ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    names = [k for k in (evals[0] if evals else {}) if k != "step"]
    for name in names:
        points = [(e["step"], e[name]) for e in evals if isinstance(e.get(name), (int, float))]
        if points:
            bold = name == watched
            ax_val.plot(*zip(*points), marker="o", markersize=3, linewidth=2.2 if bold else 1.0,
                        label=f"{name} (early stop)" if bold else name)
    ax_val.set_xlabel("step")
    ax_val.set_ylabel("validation metric")
    ax_val.grid(alpha=0.3)
    if names:
        ax_val.legend(fontsize=8)
    else:
        ax_val.text(0.5, 0.5, "no validation ran", ha="center", va="center", transform=ax_val.transAxes)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_diagnostics(report: DiagnosticsReport, train_len: int, path: str | os.PathLike[str], title: str = "") -> Path | None:
    """Rows: recurrent layers; columns: effective rank per head, residual ratio per token.
    Attention layers have no row; the title names them."""
    layers = len(report.erank)
    if layers == 0:
        return None
    fig, axes = plt.subplots(layers, 2, figsize=(12, 3.2 * layers), squeeze=False)
    for row in range(layers):
        li = report.layer_index(row)
        ax_rank, ax_q = axes[row]
        for h, curve in enumerate(report.erank[row]):
            ax_rank.plot(_positions(curve), curve, label=f"head {h}")
        ax_rank.set_ylabel(f"layer {li}: effective rank")
        q = report.residual_ratio[row]
        q_geo = report.metrics.get(f"q_geo@{li}", float("nan"))
        ax_q.plot(_positions(q), q, label=f"q_t (q_geo = {q_geo:.3g})")
        ax_q.set_yscale("log")
        ax_q.set_ylabel("residual ratio q_t")
        for ax in (ax_rank, ax_q):
            ax.axvline(train_len, color="grey", linestyle="--", linewidth=1, label="training length")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("position t")
    norm = report.metrics.get("max_factor_norm")
    suffix = f" (largest transition-factor norm {norm:.3f})" if norm is not None else ""
    if report.notes:
        suffix += f"; attention layers {', '.join(map(str, sorted(report.notes)))} not shown (no recurrent state)"
    fig.suptitle((title + suffix).strip())
    return _save(fig, path)
