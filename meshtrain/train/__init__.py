"""Training: state (sharded init), step, the Trainer loop, metrics."""

from meshtrain.train.config import Progress, Resume, TrainConfig, default_optimizer
from meshtrain.train.trainer import Trainer, TrainingError, TrainSummary

__all__ = ["Progress", "Resume", "TrainConfig", "TrainSummary", "Trainer", "TrainingError", "default_optimizer"]
