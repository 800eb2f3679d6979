"""Training: step, the Trainer loop and its tasks (model + loss + data), metrics."""

from meshtrain.train.config import MemoryCheckMode, Progress, Resume, TrainConfig, default_optimizer
from meshtrain.train.tasks import DataRequest, Task, custom_task
from meshtrain.train.trainer import Interrupted, Trainer, TrainingError, TrainSummary

__all__ = ["DataRequest", "Interrupted", "MemoryCheckMode", "Progress", "Resume", "Task", "TrainConfig",
           "TrainSummary", "Trainer", "TrainingError", "custom_task", "default_optimizer"]
