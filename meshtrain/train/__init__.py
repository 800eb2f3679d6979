"""Training: step, the Trainer (a step generator plus hooks) and its tasks (model + loss + data), metrics."""

from meshtrain.train.config import MemoryCheckMode, Progress, Resume, TrainConfig, default_optimizer
from meshtrain.train.hooks import (CheckpointHook, EvalHook, Hook, MetricsHook, PreemptionHook, ProgressHook,
                                   ThroughputHook)
from meshtrain.train.loop import (EvalResult, Interrupted, Run, RunResults, StepInfo, Stop, ThroughputResult, TrainingError,
                                  TrainSummary)
from meshtrain.train.tasks import DataRequest, Task, custom_task
from meshtrain.train.trainer import Trainer

__all__ = ["CheckpointHook", "DataRequest", "EvalHook", "EvalResult", "Hook", "Interrupted", "MemoryCheckMode", "MetricsHook",
           "PreemptionHook", "Progress", "ProgressHook", "Resume", "Run", "RunResults", "StepInfo", "Stop", "Task",
           "ThroughputHook", "ThroughputResult", "TrainConfig", "TrainSummary", "Trainer", "TrainingError", "custom_task",
           "default_optimizer"]
