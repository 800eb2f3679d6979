"""meshtrain: write a Flax NNX model once with logical axis names, pick a recipe, train anywhere.

The public API, re-exported lazily from small modules (nothing heavy loads until a name is used)::

    import meshtrain as mt
    recipe = mt.get_recipe("fsdp")
    abstract = mt.abstract_state(mt.models.model_factory("tiny"), optax.adamw(1e-3))
    plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(16, 128))
    state = mt.init_state(plan, seed=0)
    step = mt.make_train_step(plan)
"""

import importlib as _importlib
import pkgutil as _pkgutil
import typing as _typing

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below loads each name
    from meshtrain import models
    from meshtrain.abstract import AbstractState, ModelFactory, ParamInfo, abstract_state, list_params
    from meshtrain.annotate import ModelRules, PathRules, StepContext, constrain, remat, scan_layers
    from meshtrain.axes import LOGICAL_AXES, MESH_AXES, register_logical_axis
    from meshtrain.batch_layout import BatchLayout, BatchLeaf
    from meshtrain.checkpoint import CheckpointError, Checkpointer, Restored, SaveResult, inspect_checkpoint
    from meshtrain.errors import ConfigError, MeshError, MeshtrainError, PlanError, RecipeError, RulesError
    from meshtrain.mesh import AxisTypes, MeshSpec
    from meshtrain.parallel.attention import attention
    from meshtrain.parallel.context import sequence_permutation
    from meshtrain.parallel.pipeline import PipelineParts
    from meshtrain.plan import BatchSpec, LeafPlan, ShardingPlan, make_plan
    from meshtrain.precision import master_weights
    from meshtrain.recipes import (BUILTIN_RECIPES, AttentionKind, LayerLoop, LocalAttention, Offload, Recipe, Remat, Schedule,
                                   get_recipe, register_recipe)
    from meshtrain.rules import AxisRules, Rule
    from meshtrain.strategies import (FSDP, HSDP, Context, ContextKind, DataParallel, Expert, FlashBackend, LoadBalance,
                                      Pipeline, Strategy, Tensor, ZeRO, ZeroStage, register_strategy)
    from meshtrain.state import TrainState, abstract_train_state, init_state, state_shardings
    from meshtrain.losses import LossFn, next_token_loss
    from meshtrain.train.hooks import Hook
    from meshtrain.train.loop import StepInfo, Stop
    from meshtrain.train.step import NonFinite, make_eval_step, make_grad_fn, make_train_step
    from meshtrain.generation import generate

__version__ = "0.1.0"

#: Where each public name lives (``mt.models`` and the other submodules load as submodules): ``mt.<name>`` imports its module on first use (PEP 562), so
#: ``import meshtrain`` (and ``meshtrain launch``, the supervisor) loads no JAX. Keep in step with
#: the ``TYPE_CHECKING`` imports above (tests/test_code_rules.py checks both name the same objects).
_EXPORTS = {
    "AbstractState": "meshtrain.abstract",
    "ModelFactory": "meshtrain.abstract",
    "ParamInfo": "meshtrain.abstract",
    "abstract_state": "meshtrain.abstract",
    "list_params": "meshtrain.abstract",
    "ModelRules": "meshtrain.annotate",
    "PathRules": "meshtrain.annotate",
    "StepContext": "meshtrain.annotate",
    "constrain": "meshtrain.annotate",
    "remat": "meshtrain.annotate",
    "scan_layers": "meshtrain.annotate",
    "LOGICAL_AXES": "meshtrain.axes",
    "MESH_AXES": "meshtrain.axes",
    "register_logical_axis": "meshtrain.axes",
    "BatchLayout": "meshtrain.batch_layout",
    "BatchLeaf": "meshtrain.batch_layout",
    "CheckpointError": "meshtrain.checkpoint",
    "Checkpointer": "meshtrain.checkpoint",
    "Restored": "meshtrain.checkpoint",
    "SaveResult": "meshtrain.checkpoint",
    "inspect_checkpoint": "meshtrain.checkpoint",
    "ConfigError": "meshtrain.errors",
    "MeshError": "meshtrain.errors",
    "MeshtrainError": "meshtrain.errors",
    "PlanError": "meshtrain.errors",
    "RecipeError": "meshtrain.errors",
    "RulesError": "meshtrain.errors",
    "AxisTypes": "meshtrain.mesh",
    "MeshSpec": "meshtrain.mesh",
    "attention": "meshtrain.parallel.attention",
    "sequence_permutation": "meshtrain.parallel.context",
    "PipelineParts": "meshtrain.parallel.pipeline",
    "BatchSpec": "meshtrain.plan",
    "LeafPlan": "meshtrain.plan",
    "ShardingPlan": "meshtrain.plan",
    "make_plan": "meshtrain.plan",
    "master_weights": "meshtrain.precision",
    "BUILTIN_RECIPES": "meshtrain.recipes",
    "AttentionKind": "meshtrain.recipes",
    "LayerLoop": "meshtrain.recipes",
    "LocalAttention": "meshtrain.recipes",
    "Offload": "meshtrain.recipes",
    "Recipe": "meshtrain.recipes",
    "Remat": "meshtrain.recipes",
    "Schedule": "meshtrain.recipes",
    "get_recipe": "meshtrain.recipes",
    "register_recipe": "meshtrain.recipes",
    "AxisRules": "meshtrain.rules",
    "Rule": "meshtrain.rules",
    "FSDP": "meshtrain.strategies",
    "HSDP": "meshtrain.strategies",
    "Context": "meshtrain.strategies",
    "ContextKind": "meshtrain.strategies",
    "DataParallel": "meshtrain.strategies",
    "Expert": "meshtrain.strategies",
    "FlashBackend": "meshtrain.strategies",
    "LoadBalance": "meshtrain.strategies",
    "Pipeline": "meshtrain.strategies",
    "Strategy": "meshtrain.strategies",
    "Tensor": "meshtrain.strategies",
    "ZeRO": "meshtrain.strategies",
    "ZeroStage": "meshtrain.strategies",
    "register_strategy": "meshtrain.strategies",
    "TrainState": "meshtrain.state",
    "abstract_train_state": "meshtrain.state",
    "init_state": "meshtrain.state",
    "state_shardings": "meshtrain.state",
    "LossFn": "meshtrain.losses",
    "next_token_loss": "meshtrain.losses",
    "Hook": "meshtrain.train.hooks",
    "StepInfo": "meshtrain.train.loop",
    "Stop": "meshtrain.train.loop",
    "NonFinite": "meshtrain.train.step",
    "make_eval_step": "meshtrain.train.step",
    "make_grad_fn": "meshtrain.train.step",
    "make_train_step": "meshtrain.train.step",
    "generate": "meshtrain.generation",
}

__all__ = [
    "AbstractState", "AttentionKind", "AxisRules", "AxisTypes", "BUILTIN_RECIPES", "BatchLayout", "BatchLeaf",
    "BatchSpec", "CheckpointError",
    "Checkpointer", "ConfigError", "Restored", "SaveResult", "inspect_checkpoint",
    "LOGICAL_AXES", "LeafPlan", "LossFn", "MESH_AXES", "MeshError", "MeshSpec", "MeshtrainError", "ModelFactory",
    "ModelRules", "NonFinite", "ParamInfo", "PathRules", "PlanError", "Recipe", "RecipeError", "Remat", "Rule", "RulesError",
    "ShardingPlan", "StepContext", "StepInfo", "Stop", "Hook", "TrainState", "abstract_state", "abstract_train_state", "list_params", "attention",
    "constrain", "get_recipe", "init_state", "make_eval_step", "make_grad_fn", "make_plan", "make_train_step", "models",
    "next_token_loss", "register_logical_axis", "register_recipe", "register_strategy", "remat", "state_shardings",
    "sequence_permutation", "PipelineParts", "Schedule", "LayerLoop", "Offload", "master_weights", "scan_layers",
    "Strategy", "DataParallel", "FSDP", "ZeRO", "ZeroStage", "HSDP", "Tensor", "Context", "ContextKind", "LoadBalance",
    "FlashBackend", "Expert", "Pipeline", "LocalAttention", "generate",
]


#: Submodules ``mt.<module>`` reaches on first use (the CLI entry point is not one of them).
_SUBMODULES = frozenset(m.name for m in _pkgutil.iter_modules(__path__) if m.name != "__main__")


def __getattr__(name: str) -> _typing.Any:
    """Load a public name's module on first use and keep the name here (PEP 562)."""
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list:
    """The public names and submodules (loaded or not), not this module's helpers."""
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__) | _SUBMODULES)
