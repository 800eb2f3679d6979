"""Seeing a run before it runs: memory per device, collectives (compiled HLO and analytic), hardware
profiles, step time and MFU, and the planner that ranks recipes and meshes.

Example::

    from meshtrain.analysis import estimate_memory, estimate_step_time, get_hardware, plan_auto
    est = estimate_memory(plan, cfg)                      # bytes per device by component
    t = estimate_step_time(plan, cfg, get_hardware("h100"))
    result = plan_auto(PlanRequest(cfg, num_devices=256, hardware="tpu-v5p"))
    estimate_memory(plan, None, loss_fn=my_loss)          # any model: from its compiled / traced step
    compiled_flops_per_step(plan, my_loss)                # FLOPs of one step, for MFU of any model

The formulas behind every number are in the docstrings of the modules that compute them:
``memory``, ``activations``, ``comms``, ``flops``, ``steptime``, ``hardware``, ``compiled`` (any model).
"""

from meshtrain.analysis.activations import ActivationModel, ActivationSplit, saved_activations
from meshtrain.analysis.benchmark import StateInit, compare_rankings, compile_recipe, time_round_robin
from meshtrain.analysis.collectives import Collective, hlo_collectives, per_axis, summarize, wire_bytes
from meshtrain.analysis.comms import Backend, CollectiveEstimate, analytic_collectives, per_axis_estimate
from meshtrain.analysis.compiled import (ProgramCost, compiled_flops_per_step, jaxpr_flops, program_cost,
                                         saved_activation_bytes)
from meshtrain.analysis.flops import model_flops_per_token, step_flops
from meshtrain.analysis.hardware import PROFILES, Hardware, get_hardware, hardware_names, measure_cpu
from meshtrain.analysis.layout import PlanLayout, layout_of
from meshtrain.analysis.memory import (Component, Fit, MeasuredMemory, MemoryEstimate, ZeroPartitioning,
                                       estimate_memory, zero_model_state)
from meshtrain.analysis.moe import moe_summary
from meshtrain.analysis.steptime import StepTimeEstimate, estimate_step_time

__all__ = [
    "ActivationModel", "ActivationSplit", "Backend", "Collective", "CollectiveEstimate", "Component", "Fit",
    "Hardware", "MeasuredMemory", "MemoryEstimate", "PROFILES", "PlanLayout", "ProgramCost", "StateInit",
    "StepTimeEstimate", "ZeroPartitioning", "analytic_collectives", "compare_rankings", "compile_recipe",
    "compiled_flops_per_step", "estimate_memory", "estimate_step_time", "get_hardware", "hardware_names",
    "hlo_collectives", "jaxpr_flops", "layout_of", "measure_cpu", "model_flops_per_token", "per_axis",
    "per_axis_estimate", "program_cost", "saved_activation_bytes", "saved_activations", "step_flops", "summarize",
    "time_round_robin", "wire_bytes", "zero_model_state", "moe_summary",
]
