"""Training: step, the Trainer (a step generator plus hooks) and its tasks (model + loss + data), metrics.

The names below load their modules on first use (PEP 562), so a light submodule
(``meshtrain.train.preflight``) imports without the trainer and JAX::

    from meshtrain.train import Trainer, TrainConfig
"""

import typing as _typing

from meshtrain.lazy_exports import lazy_exports as _lazy_exports

if _typing.TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads each name
    from meshtrain.train.config import MemoryCheckMode, Progress, Resume, TrainConfig, default_optimizer
    from meshtrain.train.hooks import (CheckpointHook, EvalHook, Hook, MetricsHook, PreemptionHook, ProgressHook,
                                       ThroughputHook)
    from meshtrain.train.loop import (EvalResult, Interrupted, Run, RunResults, StepInfo, Stop, ThroughputResult,
                                      TrainingError, TrainSummary)
    from meshtrain.train.tasks import DataRequest, Task, custom_task
    from meshtrain.train.trainer import Trainer

_EXPORTS = {
    **dict.fromkeys(("MemoryCheckMode", "Progress", "Resume", "TrainConfig", "default_optimizer"),
                    "meshtrain.train.config"),
    **dict.fromkeys(("CheckpointHook", "EvalHook", "Hook", "MetricsHook", "PreemptionHook", "ProgressHook",
                     "ThroughputHook"), "meshtrain.train.hooks"),
    **dict.fromkeys(("EvalResult", "Interrupted", "Run", "RunResults", "StepInfo", "Stop", "ThroughputResult",
                     "TrainingError", "TrainSummary"), "meshtrain.train.loop"),
    **dict.fromkeys(("DataRequest", "Task", "custom_task"), "meshtrain.train.tasks"),
    "Trainer": "meshtrain.train.trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS)  # a name or submodule loads on first use
