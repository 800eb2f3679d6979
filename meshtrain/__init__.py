"""meshtrain: write a Flax NNX model once with logical axis names, pick a recipe, train anywhere.

The public API, re-exported lazily from small modules (nothing heavy loads until a name is used)::

    import meshtrain as mt
    recipe = mt.get_recipe("fsdp")
    abstract = mt.abstract_state(mt.models.model_factory("tiny"), optax.adamw(1e-3))
    plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(16, 128))
    state = mt.init_state(plan, seed=0)
    step = mt.make_train_step(plan)
"""

import typing as _typing

from meshtrain.lazy_exports import lazy_exports as _lazy_exports

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below loads each name
    from meshtrain import models
    from meshtrain.abstract import (AbstractState, ModelFactory, ParamInfo, abstract_state, list_model_state,
                                    list_params)
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


def _names(module: str, names: str) -> dict:
    return dict.fromkeys(names.split(), module)


#: Where each public name lives: ``mt.<name>`` imports its module on first use (PEP 562), so ``import
#: meshtrain`` (and ``meshtrain launch``, the supervisor) loads no JAX; ``mt.models`` and the other
#: submodules load as submodules. Keep in step with the ``TYPE_CHECKING`` imports above
#: (tests/test_code_rules.py checks that both name the same objects).
_EXPORTS = {
    **_names("meshtrain.abstract", "AbstractState ModelFactory ParamInfo abstract_state list_model_state list_params"),
    **_names("meshtrain.annotate", "ModelRules PathRules StepContext constrain remat scan_layers"),
    **_names("meshtrain.axes", "LOGICAL_AXES MESH_AXES register_logical_axis"),
    **_names("meshtrain.batch_layout", "BatchLayout BatchLeaf"),
    **_names("meshtrain.checkpoint", "CheckpointError Checkpointer Restored SaveResult inspect_checkpoint"),
    **_names("meshtrain.errors", "ConfigError MeshError MeshtrainError PlanError RecipeError RulesError"),
    **_names("meshtrain.mesh", "AxisTypes MeshSpec"),
    **_names("meshtrain.parallel.attention", "attention"),
    **_names("meshtrain.parallel.context", "sequence_permutation"),
    **_names("meshtrain.parallel.pipeline", "PipelineParts"),
    **_names("meshtrain.plan", "BatchSpec LeafPlan ShardingPlan make_plan"),
    **_names("meshtrain.precision", "master_weights"),
    **_names("meshtrain.recipes", "BUILTIN_RECIPES AttentionKind LayerLoop LocalAttention Offload Recipe Remat "
                                  "Schedule get_recipe register_recipe"),
    **_names("meshtrain.rules", "AxisRules Rule"),
    **_names("meshtrain.strategies", "FSDP HSDP Context ContextKind DataParallel Expert FlashBackend LoadBalance "
                                     "Pipeline Strategy Tensor ZeRO ZeroStage register_strategy"),
    **_names("meshtrain.state", "TrainState abstract_train_state init_state state_shardings"),
    **_names("meshtrain.losses", "LossFn next_token_loss"),
    **_names("meshtrain.train.hooks", "Hook"),
    **_names("meshtrain.train.loop", "StepInfo Stop"),
    **_names("meshtrain.train.step", "NonFinite make_eval_step make_grad_fn make_train_step"),
    **_names("meshtrain.generation", "generate"),
}

__all__ = [*_EXPORTS, "models"]


#: A public name or a submodule (``mt.<module>``) loads on first use (meshtrain.lazy_exports).
__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS, extra=("models",))
