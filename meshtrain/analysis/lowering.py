"""Lower or compile a plan's train step without running it: locally, on an ``AbstractMesh`` for a
pod-sized mesh, or for a fake TPU topology (needs libtpu).

Example::

    compiled = compile_local(plan)                    # plan on a real Mesh (≤ local devices)
    MeasuredMemory.of(compiled), hlo_collectives(compiled.as_text(), plan.mesh)
    lowered = lower_abstract(plan, platform="tpu")    # plan on an AbstractMesh: StableHLO with shardings
    lowered_summary(lowered)                          # {"arguments": n, "sharded_arguments": k, ...}
    compiled = compile_tpu_topology(abstract, recipe, BatchSpec(B, T), "v5e:4x4")   # exact per-chip memory

A lowered (not compiled) module is the program before SPMD partitioning: it carries every
argument's sharding but no collectives yet. A real compile for a TPU topology needs libtpu
(``pip install 'meshtrain[tpu]'``); without it :func:`tpu_available` is False and
:func:`compile_tpu_topology` raises a ``ConfigError`` naming the extra.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

from meshtrain.analysis.compiled import step_inputs
from meshtrain.errors import ConfigError
from meshtrain.plan import make_plan
from meshtrain.train.step import make_train_step

#: Fake topologies for common slice sizes: chips → topology string per TPU generation.
_TOPOLOGIES = {
    "tpu-v5e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "tpu-v6e": {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "tpu-v5p": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"},
    "tpu-v4": {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"},
}


def _abstract_inputs(plan):
    return step_inputs(plan)


def compile_local(plan, loss_fn=None):
    """Compile ``make_train_step(plan, loss_fn=loss_fn)`` for the plan's (real) mesh; nothing is
    allocated or run."""
    import jax

    if isinstance(plan.mesh, jax.sharding.AbstractMesh):
        raise ConfigError(f"the plan is on an AbstractMesh of {plan.num_devices} devices; only meshes of devices "
                          f"that exist here can be compiled (use lower_abstract, or --devices ≤ "
                          f"{len(jax.devices())})")
    state, batch = _abstract_inputs(plan)
    return make_train_step(plan, loss_fn=loss_fn).lower(state, batch).compile()


def lower_abstract(plan, platform: str = "tpu", loss_fn=None):
    """Trace and lower the train step on the plan's ``AbstractMesh`` for ``platform`` (tpu, cuda, cpu)."""
    import jax

    state, batch = _abstract_inputs(plan)
    step = make_train_step(plan, loss_fn=loss_fn)
    mesh = plan.mesh if isinstance(plan.mesh, jax.sharding.AbstractMesh) else plan.mesh.abstract_mesh
    with jax.sharding.use_abstract_mesh(mesh):
        return step.trace(state, batch).lower(lowering_platforms=(platform,))


def lowered_summary(lowered) -> Dict[str, int]:
    """Arguments of the lowered ``main`` and how many carry a non-trivial sharding."""
    text = lowered.as_text()
    header = next((line for line in text.splitlines() if "func.func public @main(" in line), "")
    args = re.split(r"%arg\d+: ", header)[1:]
    sharded = sum(1 for a in args if re.search(r'\{"[a-z_]+"', a) or "devices=[" in a)
    return {"arguments": len(args), "sharded_arguments": sharded, "text_chars": len(text)}


def tpu_available() -> bool:
    """Whether libtpu is importable (the ``tpu`` extra), without starting a TPU backend."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def default_topology(hardware: str, num_devices: int) -> Optional[str]:
    """``"v5e:4x4"``-style name for ``num_devices`` chips of a TPU generation, if a common one exists."""
    shape = _TOPOLOGIES.get(hardware, {}).get(num_devices)
    return f"{hardware.replace('tpu-', '')}:{shape}" if shape else None


def compile_tpu_topology(abstract, recipe, batch, topology: str, loss_fn=None):
    """Compile the train step for a fake TPU ``topology`` (e.g. ``"v5p:4x4x4"``) on this host.

    Returns ``(plan, compiled)``; ``MeasuredMemory.of(compiled)`` is then the exact per-chip memory
    XLA:TPU assigns. Raises ``ConfigError`` when libtpu is not installed.
    """
    if not tpu_available():
        raise ConfigError("compiling for a TPU topology needs libtpu: pip install 'meshtrain[tpu]' "
                          "(or pip install libtpu); the analytic estimates need nothing")
    import jax
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology, "tpu")
    except Exception as exc:  # noqa: BLE001 - libtpu reports bad names in several ways
        raise ConfigError(f"cannot build TPU topology {topology!r}: {exc}; use e.g. 'v5e:4x4' or 'v5p:2x2x2'") \
            from None
    mesh = recipe.mesh.build(list(topo.devices))
    plan = make_plan(abstract, recipe, mesh, batch=batch)
    state, batch_abs = _abstract_inputs(plan)
    compiled = make_train_step(plan, loss_fn=loss_fn).lower(state, batch_abs).compile()
    del jax
    return plan, compiled
