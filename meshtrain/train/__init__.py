"""Training: step, the Trainer (a step generator plus hooks) and its tasks (model + loss + data), metrics.

The names below load their modules on first use (PEP 562), so a light submodule
(``meshtrain.train.preflight``) imports without the trainer and JAX::

    from meshtrain.train import Trainer, TrainConfig
"""

import importlib as _importlib
import pkgutil as _pkgutil
import typing as _typing

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
_SUBMODULES = frozenset(m.name for m in _pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> _typing.Any:
    """Load a name's module on first use and keep the name here (PEP 562)."""
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__) | _SUBMODULES)
