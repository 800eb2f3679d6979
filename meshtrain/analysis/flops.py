"""The FLOPs formulas live with the models (:mod:`meshtrain.models.flops`); re-exported here for the
planner and existing imports."""

from meshtrain.models.flops import *  # noqa: F401,F403
from meshtrain.models.flops import attention_flops_per_token, matmul_params, model_flops_per_token, step_flops  # noqa: F401
