"""Estimates for any model (no analytic formula needed): from the program the train step compiles.

The decoder has analytic formulas (:mod:`memory`, :mod:`flops`, :mod:`comms`). Any other model — a
built-in ViT or BERT, or a user's factory — is measured on its own train step instead::

    cost = program_cost(plan, loss_fn)            # traces, and compiles when the mesh has devices
    cost.flops, cost.memory.peak, cost.collectives
    compiled_flops_per_step(plan, loss_fn)        # FLOPs of one optimizer step, all devices together
    saved_activation_bytes(plan, loss_fn)         # what the backward keeps per device (traced, any mesh)

What comes from where:

* **FLOPs** (:func:`jaxpr_flops`): counted on the step's jaxpr, the program ``jit`` compiles:
  every ``dot_general`` ``2 · output elements · contracted size``, every convolution
  ``2 · output elements · kernel elements / output features``; the body of a ``scan`` ×
  its length, a ``shard_map`` body × the devices it runs on, the larger branch of a ``cond``.
  Rematerialisation is part of the program, so its recomputed forward is counted. Elementwise
  ops (norms, softmax, the optimizer update) are not counted (a few % of a transformer).
  Not ``compiled.cost_analysis()["flops"] × devices``: XLA's cost analysis counts the body of a
  ``while`` loop once (measured on jax 0.10: a 10-step scan of matmuls reports 1/10 of its FLOPs),
  so a model that scans its layers would be under-counted ``L`` times. ``cost.xla_flops`` keeps
  XLA's figure for comparison (equal up to the elementwise share for a program without loops).
* **Memory** (real ``Mesh``): ``compiled.memory_analysis()`` of the step compiled for the plan's
  devices: peak = argument + output − alias (donated) + temp bytes, exact for this backend.
* **Memory** (``AbstractMesh``, more devices than exist): nothing can be compiled, so the loss's
  VJP is traced abstractly at one device's micro-batch and its residuals (the tensors the backward
  keeps) are summed, with the working buffers the trace shows (tensor parallelism's all-reduces,
  remat's recompute): :mod:`meshtrain.analysis.traced`. Compile with ``--check tpu`` (libtpu) or on
  the real devices for exact figures.
* **Collectives**: from the compiled HLO (:func:`meshtrain.analysis.collectives.hlo_collectives`)
  on a real mesh; on an ``AbstractMesh`` the parameter collectives of :mod:`comms` (FSDP gathers,
  gradient reductions), without tensor-parallel activation collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax

from meshtrain.analysis.collectives import Collective, hlo_collectives
from meshtrain.analysis.traced import (TracedActivations, _need_loss, gathered_layer_bytes,  # noqa: F401 (re-export)
                                       local_rows, saved_activation_bytes, traced_activations, working_weight_bytes)
from meshtrain.errors import ConfigError
from meshtrain.losses import next_token_loss
from meshtrain.models.bert import BertConfig, mlm_loss
from meshtrain.models.decoder import DecoderConfig
from meshtrain.models.flops import jaxpr_flops  # noqa: F401 (re-export)
from meshtrain.models.vit import ViTConfig, vit_loss
from meshtrain.state import abstract_train_state
from meshtrain.train.step import make_train_step

#: Where a figure came from (``MemoryEstimate.source``, ``StepTimeEstimate.source``).
ANALYTIC = "analytic"
COMPILED = "from the compiled program"
TRACED = "from the traced program"


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """``compiled.memory_analysis()`` per device, with ``peak = argument + output − alias + temp``."""

    argument: int
    output: int
    alias: int
    temp: int

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled) -> "MeasuredMemory":
        ma = compiled.memory_analysis()
        return cls(int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes), int(ma.alias_size_in_bytes),
                   int(ma.temp_size_in_bytes))

    def to_dict(self) -> Dict[str, int]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def is_abstract(plan) -> bool:
    return isinstance(plan.mesh, jax.sharding.AbstractMesh)


def has_analytic_model(cfg) -> bool:
    """True for a ``DecoderConfig`` (the analytic memory, FLOPs and collective formulas apply)."""

    return isinstance(cfg, DecoderConfig)


def default_loss(cfg, plan=None) -> Optional[Callable]:
    """The built-in loss for a built-in config: next-token (decoder), ``vit_loss``, ``mlm_loss`` (BERT);
    ``None`` for anything else (a user model must name its loss), or when ``plan``'s batch lacks the
    keys that loss reads (e.g. a BERT planned for classification)."""

    losses = {DecoderConfig: (next_token_loss, ("inputs", "targets")), ViTConfig: (vit_loss, ("images", "labels")),
              BertConfig: (mlm_loss, ("input_ids", "targets"))}
    found = next((v for k, v in losses.items() if isinstance(cfg, k)), None)
    if found is None:
        return None
    fn, keys = found
    if plan is not None and plan.batch is not None:
        paths = {p for p, _ in plan.batch.leaves()}
        if not set(keys) <= paths:
            return None
    return fn


def step_inputs(plan, batch_abstract=None) -> Tuple[Any, Any]:
    """``(state, batch)`` as ``ShapeDtypeStruct``s carrying the plan's shardings (nothing allocated).

    ``batch_abstract``: a pytree of ``ShapeDtypeStruct``s or arrays like the plan's batch (default:
    the plan's layout); its leaves get the plan's batch shardings.
    """

    if plan.batch is None:
        raise ConfigError("estimating a step needs a plan with a batch: make_plan(..., batch=BatchSpec(B, T)) or "
                          "batch=BatchLayout.from_example(example_batch)")
    if batch_abstract is None:
        batch = plan.batch.abstract(plan.batch_shardings)
    else:
        batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch_abstract,
                             plan.batch_shardings)
    return abstract_train_state(plan), batch


def trace_step(plan, loss_fn=None, batch_abstract=None):
    """``make_train_step(plan, loss_fn).trace(...)`` on abstract inputs (an ``AbstractMesh`` too)."""

    state, batch = step_inputs(plan, batch_abstract)
    step = make_train_step(plan, loss_fn=loss_fn)
    if is_abstract(plan):
        with jax.sharding.use_abstract_mesh(plan.mesh):
            return step.trace(state, batch)
    return step.trace(state, batch)


def compile_step(plan, loss_fn=None, batch_abstract=None):
    """The train step compiled for the plan's devices (nothing allocated or run)."""
    if is_abstract(plan):
        raise ConfigError(f"the plan is on an AbstractMesh of {plan.num_devices} devices, more than this machine "
                          f"has ({len(jax.devices())}); only meshes of existing devices compile. Estimates come "
                          f"from the traced program; for exact per-device memory compile for the target (`--check "
                          f"tpu` with libtpu) or plan on the real devices")
    return trace_step(plan, loss_fn, batch_abstract).lower().compile()


# -- FLOPs --------------------------------------------------------------------------------------

def compiled_flops_per_step(plan, loss_fn=None, batch_abstract=None) -> float:
    """FLOPs of one train step of ``plan`` over the whole global batch (all devices together).

    Counted on the program ``make_train_step(plan, loss_fn=loss_fn)`` compiles (its jaxpr): every
    matmul ``2·M·N·K`` and convolution, layer scans × their length, rematerialised forward passes
    included (they are executed). MFU for any model::

        MFU = compiled_flops_per_step(plan, loss_fn) / (step seconds · devices · peak FLOP/s per device)

    This counts what runs, recompute included: with ``remat`` it is above the decoder's
    ``6·N·tokens + attention`` convention (:mod:`meshtrain.analysis.flops`), which counts useful work.
    Why not ``cost_analysis()["flops"] × devices``: XLA counts a ``while`` body once (see the module
    docstring). Needs no devices (an ``AbstractMesh`` plan works); takes about a trace (≤ 1 s for small
    models), no compile. ``loss_fn`` defaults to next-token cross-entropy; ``batch_abstract``
    (``ShapeDtypeStruct``s) to the plan's batch layout.
    """
    return jaxpr_flops(trace_step(plan, loss_fn, batch_abstract).jaxpr)


# -- one object for the report ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What the step's program says about itself (see the module docstring).

    ``flops``: :func:`jaxpr_flops` of the step, all devices together. ``source``: :data:`COMPILED`
    (compiled for the plan's devices: ``memory``, ``collectives``, ``xla_flops`` set) or
    :data:`TRACED` (an ``AbstractMesh``: only traced). ``activations``: :func:`saved_activation_bytes`
    and ``working_set``: what tensor parallelism's all-reduces add to the backward's peak, ``recompute``: what
    recomputing a remat segment in the backward holds, ``gradient``: the first weight gradient the backward makes,
    at full size before its reduce-scatter (:class:`TracedActivations`; traced plans only).
    ``xla_flops``: ``cost_analysis()["flops"] × devices`` (while bodies once).
    """

    source: str
    num_devices: int
    flops: float
    memory: Optional[MeasuredMemory] = None
    collectives: Tuple[Collective, ...] = ()
    xla_flops: Optional[float] = None
    activations: Optional[int] = None
    working_set: Optional[int] = None
    recompute: Optional[int] = None
    gradient: Optional[int] = None

    @property
    def flops_per_device(self) -> float:
        return self.flops / max(self.num_devices, 1)

    def to_dict(self) -> Dict[str, object]:
        return {"source": self.source, "num_devices": self.num_devices, "flops": self.flops,
                "xla_cost_analysis_flops": self.xla_flops, "activations": self.activations,
                "working_set": self.working_set, "recompute": self.recompute, "gradient": self.gradient,
                "memory": self.memory.to_dict() if self.memory else None}


def program_cost(plan, loss_fn, batch_abstract=None, *, compile: Optional[bool] = None) -> ProgramCost:
    """Trace (and, on a real mesh, compile) the step of ``plan`` with ``loss_fn``.

    ``compile``: default ``True`` on a ``Mesh`` of existing devices, ``False`` on an ``AbstractMesh``
    (then the activations are traced: :func:`saved_activation_bytes`).
    """
    loss_fn = _need_loss(loss_fn, "an estimate")
    compile = (not is_abstract(plan)) if compile is None else compile
    traced = trace_step(plan, loss_fn, batch_abstract)
    flops = jaxpr_flops(traced.jaxpr)
    if not compile:
        acts = traced_activations(plan, loss_fn)
        return ProgramCost(TRACED, plan.num_devices, flops, activations=acts.saved, working_set=acts.working,
                           recompute=acts.recompute, gradient=acts.gradient)
    if is_abstract(plan):
        compile_step(plan, loss_fn, batch_abstract)  # raises the explanation
    compiled = traced.lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost.get("flops", 0.0)) * plan.num_devices if cost else None
    return ProgramCost(COMPILED, plan.num_devices, flops, MeasuredMemory.of(compiled),
                       tuple(hlo_collectives(compiled.as_text(), plan.mesh)), xla)


__all__ = ["ANALYTIC", "COMPILED", "TRACED", "MeasuredMemory", "ProgramCost", "compile_step",
           "compiled_flops_per_step", "default_loss", "has_analytic_model", "jaxpr_flops", "local_rows",
           "program_cost", "saved_activation_bytes", "step_inputs", "trace_step", "traced_activations",
           "TracedActivations", "gathered_layer_bytes", "working_weight_bytes"]
