"""meshtrain: write a Flax NNX model once with logical axis names, pick a recipe, train anywhere.

The public API, re-exported from small modules::

    import meshtrain as mt
    recipe = mt.get_recipe("fsdp")
    abstract = mt.abstract_state(mt.models.model_factory("tiny"), optax.adamw(1e-3))
    plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(16, 128))
    state = mt.init_state(plan, seed=0)
    step = mt.make_train_step(plan)
"""

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
