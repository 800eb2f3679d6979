"""Restore one checkpoint step onto a plan's shardings (another recipe, mesh or device count reshards
on load, and a change of parameter precision is bridged through the master weights).

Which step to restore, and whether it passed its check, is decided by
:meth:`~meshtrain.checkpoint.Checkpointer.restore`; :func:`read_step` reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from meshtrain.checkpoint.adapters import holds_adapters, merged_params, read_lora_parts
from meshtrain.checkpoint.inspection import read_meta
from meshtrain.checkpoint.layout import flat_paths, from_nested, key_name, mismatch_error, mismatches, to_nested
from meshtrain.checkpoint.types import CheckpointError, Restored
from meshtrain.precision import MasterWeightsState, has_master_weights
from meshtrain.state import TrainState, abstract_train_state


def read_step(manager: ocp.CheckpointManager, directory: Path, step: int, plan, *, allow_cast: bool) -> Restored:
    """Read ``step`` (already checked) onto ``plan``'s shardings; every leaf, scalars included, comes
    back with the plan's ``NamedSharding``. Raises :class:`CheckpointError` listing every path whose
    tree position, shape or dtype differs (dtypes are cast only with ``allow_cast=True``)."""
    meta = read_meta(directory / str(step))
    final = abstract_train_state(plan)
    target, convert = precision_bridge(meta["tree"], final)
    problems = mismatches(meta["tree"], target, allow_cast=allow_cast)
    if problems:
        raise mismatch_error(step, directory, problems, meta.get("user", {}))
    nested = to_nested(target)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=nested, restore_args=ocp.checkpoint_utils.construct_restore_args(nested)))
    try:
        out = manager.restore(step, args=args)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"restoring step {step} from {directory} failed: {type(exc).__name__}: "
                              f"{str(exc).strip()[:500]}") from exc
    state = onto_target(convert(onto_target(from_nested(out["state"], target), target)), final)
    return Restored(step, state, dict(meta.get("data_state") or {}), meta.get("user", {}), meta["tree"])


def precision_bridge(saved_tree: Dict[str, Any], final):
    """``(what to read, how to turn it into final)`` across a change of parameter precision.

    A plan with 16-bit parameters keeps f32 master weights in ``opt_state.master`` (see
    :mod:`meshtrain.precision`). From an f32 checkpoint it reads the f32 parameters as the master
    copy (bit-exact) and the optimizer state as the inner state, and rounds the working parameters;
    from a 16-bit checkpoint into an f32 plan it takes the master copy as the parameters. Otherwise
    the checkpoint is read as the plan is."""
    saved_master = any(p.startswith("opt_state/master/") for p in saved_tree)
    want_master = has_master_weights(final.opt_state)
    if saved_master == want_master:
        return final, lambda state: state
    sds = lambda t, dtype: jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding)  # noqa: E731
    if want_master:  # f32 checkpoint -> 16-bit parameters + f32 master
        master = final.opt_state.master
        target = TrainState(final.step, master, final.opt_state.inner, final.model_state)

        def convert(state):
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), state.params, final.params)
            return TrainState(state.step, params, MasterWeightsState(state.params, state.opt_state), state.model_state)
        return target, convert
    # 16-bit checkpoint with master weights -> f32 parameters from the master copy
    saved_params = {p[len("params/"):]: d for p, d in saved_tree.items() if p.startswith("params/")}
    working = jax.tree_util.tree_map_with_path(
        lambda kp, t: sds(t, jnp.dtype(saved_params.get("/".join(key_name(k) for k in kp), {}).get("dtype", t.dtype))),
        final.params)
    target = TrainState(final.step, working, MasterWeightsState(final.params, final.opt_state), final.model_state)
    return target, lambda state: TrainState(state.step, state.opt_state.master, state.opt_state.inner,
                                            state.model_state)


def onto_target(state, target):
    """Put any leaf whose sharding differs from the target's onto the target's NamedSharding."""
    def fix(x, t):
        if isinstance(x.sharding, NamedSharding) and x.sharding == t.sharding:
            return x
        return jax.device_put(x, t.sharding)
    return jax.tree.map(fix, state, target)


def read_params(manager: ocp.CheckpointManager, directory: Path, step: int, plan):
    """Only the parameters of ``step``, onto ``plan``'s parameter shardings and dtypes (fine-tuning
    from another run: its optimizer state is not read, so any optimizer or recipe may have saved
    it). A checkpoint with f32 master weights gives those (the exact values, not the 16-bit copy). A LoRA
    run's checkpoint read onto a plain model's plan gives its merged weights (:mod:`.adapters`)."""
    meta = read_meta(directory / str(step))
    saved = meta["tree"]
    final = abstract_train_state(plan).params
    if holds_adapters(saved) and not holds_adapters({f"params/{p}": 0 for p, _ in flat_paths(final)}):
        # a LoRA run read as the plain model (export, generate, --init-from): the adapters merged into the base
        parts = read_lora_parts(manager, directory, step, [p for p, _ in flat_paths(final)])
        return merged_params(parts, final, directory, step)
    source = "opt_state/master" if any(p.startswith("opt_state/master/") for p in saved) else "params"
    wanted = dict(flat_paths(final))
    problems = [f"{path}: saved {saved.get(source + '/' + path, {}).get('shape')}, planned {list(sds.shape)}"
                for path, sds in wanted.items()
                if list(saved.get(source + "/" + path, {}).get("shape", [None])) != list(sds.shape)]
    if problems:
        raise CheckpointError(f"step {step} in {directory} does not hold this model's parameters: "
                              f"{'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}")
    nested = to_nested(final)
    for part in reversed(source.split("/")):
        nested = {part: nested}
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=nested, restore_args=ocp.checkpoint_utils.construct_restore_args(nested), partial_restore=True))
    try:
        out = manager.restore(step, args=args)["state"]
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"reading the parameters of step {step} from {directory} failed: "
                              f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
    for part in source.split("/"):
        out = out[part]
    params = from_nested(out, final)
    return jax.tree.map(lambda x, t: jax.device_put(x.astype(t.dtype), t.sharding), params, final)

