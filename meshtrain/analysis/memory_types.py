"""The parts an analytic memory estimate is made of: a :class:`Component` (parameters, gradients, ...) and a
:class:`MemoryTerm` (one named part of it, bytes per device and the formula behind them). Example::

    MemoryTerm(Component.ACTIVATIONS, "saved tensors", 2**30, "the tensors remat=full saves, all layers")
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict


class Component(str, enum.Enum):
    PARAMS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    BATCH = "batch"
    OTHER = "other"  # model state, step counter, non-donated outputs (estimates for any model)
    HOST = "host memory"  # activations remat=offload keeps in pinned host memory: not in the device's total


@dataclasses.dataclass(frozen=True, slots=True)  # thousands per planner search: no __dict__ each
class MemoryTerm:
    """One named part of a component: bytes per device and the formula behind them. ``bytes`` is fractional
    only where a formula divides (a pipeline's tick weights ÷ r); a term starting "less" is negative."""

    component: Component
    name: str
    bytes: float
    formula: str

    def to_dict(self) -> Dict[str, object]:
        return {"name": self.name, "bytes": int(self.bytes), "formula": self.formula}
