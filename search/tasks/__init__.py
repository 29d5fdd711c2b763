"""Quality tasks, generated on the fly and seeded (`docs/tasks.md`).

`get_task(name, preset="cpu", **options) -> Task`; the `Task` protocol is in `base.py`.
"""

from .base import Batch, Curve, Preset, Task, TrainPreset, ValidationMetric
from .registry import PRESET_NAMES, get_task, task_names, task_options

__all__ = ["Batch", "Curve", "Preset", "Task", "TrainPreset", "ValidationMetric", "PRESET_NAMES", "get_task", "task_names", "task_options"]
