"""The zero-bubble schedule (ZB-H1, Qi et al. 2023, in lock-step SPMD): 1F1B whose backward is split
into an input-gradient half ``B`` (what the previous stage waits for) and a weight-gradient half ``W``
(what nobody waits for), with ``W`` deferred to the ticks where every stage has one.

**The schedule.** The forward and ``B`` ticks are 1F1B's: stage ``s`` runs the forward of micro-batch
``t - s`` and ``B`` of ``t - (2p-2-s)`` on tick ``t``. ``W`` of micro-batch ``j`` runs on every stage on
tick ``j + 2p - 2``, right after stage 0's ``B`` of it (the last stage to get there). So the ``W`` slot
runs on ``m`` ticks only, all of them full, while the forward and ``B`` slots still run ``m + p - 1``
ticks each: the warm-up and drain bubble holds ``F + B`` per idle slot instead of 1F1B's ``F + B + W``.

Why not the paper's ZB-H1 placement: there each device picks its own next pass, so ``W`` also fills
the idle time of stages whose neighbours are still busy. In one SPMD program every stage runs the
same slot on each tick (a slot that is idle on one stage is idle compute everywhere), so the only idle
time ``W`` can leave is the drain's: bubble ``(p-1)(1-ω)/(m + (p-1)(1-ω))`` with ``ω`` the weight
gradient's share of a stage's work (:func:`~meshtrain.parallel.pipeline.bubble_fraction`).

**How the backward splits.** Once per step, one layer's VJP (``jax.vjp`` of ``layer_fn`` w.r.t. its
weights and input) is traced from its residuals to a jaxpr and cut by liveness
(:func:`layer_split`): the equations the input cotangent needs form the ``B`` half, the rest (the
weight matmuls) the ``W`` half, and the values ``W`` reads from ``B`` (a weight matmul's input and
output cotangent) are what a micro-batch keeps between its two ticks. The ``B`` tick recomputes the
stage forward from the stashed stage input (as 1F1B does), runs ``B`` layer by layer in reverse and
stores the kept values; the ``W`` tick evaluates ``W`` on them. No work is done twice: per micro-batch
a stage runs 1F1B's forward, recomputed forward and backward, only split.

**Memory.** On top of 1F1B's stash, a stage keeps these halves for the micro-batches between their
``B`` and ``W``: at most ``p`` (stage ``p-1``: ``B`` at ``j+p-1``, ``W`` at ``j+2p-2``), a ``p``-slot
buffer (+ one slot idle ticks write to) of ``L/p`` layers × the kept values ``a_W`` per stage; with the
``B`` tick's own residuals and the values it is writing, at most ``(p+3)·(L/p)·(a_W + x)`` above 1F1B
(:func:`meshtrain.analysis.pipeline.zero_bubble_extra_bytes`; tests/test_pipeline_zero_bubble.py checks
it against ``memory_analysis``). The planner takes ``a_W`` as a layer's activations without remat
(the weight matmuls' inputs and their output cotangents, whatever the recipe's remat): an upper bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax._src import core as jcore  # Jaxpr, eval_jaxpr: the layer's backward cut into its two halves

from meshtrain.parallel.pipeline._parts import STAGE
from meshtrain.annotate import batch_split_over
from meshtrain.parallel.pipeline._schedules import (_cut_rows, _floats, _mask, _on_rows, _on_stage,
                                                    _one_f_one_b_setup, _one_f_one_b_tick, _pick, _row_split,
                                                    _run_ticks)
from meshtrain.parallel.pipeline._tables import PipelineConfig, schedule_table
from meshtrain.strategies import Schedule


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """One layer's backward cut in two (found by tracing, once per step). ``data_res``: the indices of
    the layer's VJP residual leaves that depend on the micro-batch (the others come from the weights
    alone and are recomputed where needed, not stacked); ``b_jaxpr``: ``(residuals, cotangents) ->
    (dx, kept)``, everything the input gradient needs plus what it hands on; ``w_jaxpr``: ``kept ->
    weight cotangent leaves``, only the equations the input gradient does not need (the weight
    matmuls); ``kept_avals``: what a micro-batch keeps per layer between the two."""

    data_res: Tuple[int, ...]
    b_jaxpr: Any
    w_jaxpr: Any
    consts: Tuple[Any, ...]
    kept_avals: Tuple[jax.ShapeDtypeStruct, ...]
    dw_tree: Any


def _layer_vjp(layer_fn, w_l, h, side):
    """``((y, float values), vjp_fn)`` of one layer w.r.t. its weights and input."""
    def f(ww, hh):
        y, v = layer_fn(ww, hh, side)
        return y, _floats(v)

    return jax.vjp(f, w_l, h)


def _is_var(v) -> bool:
    return type(v).__name__ != "Literal"


def _depends(jaxpr, dep_in: Sequence[bool]):
    """Which outputs of ``jaxpr`` depend on the inputs flagged in ``dep_in`` (an equation's outputs
    depend on all of its inputs: conservative for nested jaxprs; constants are not data)."""
    dep = {v: d for v, d in zip(jaxpr.invars, dep_in)}

    def of(v):
        return _is_var(v) and dep.get(v, False)

    for eqn in jaxpr.eqns:
        d = any(of(v) for v in eqn.invars)
        for o in eqn.outvars:
            dep[o] = d
    return [of(v) for v in jaxpr.outvars]


def _needed(eqns, outs) -> set:
    """Indices of the equations ``outs`` need (a backward liveness pass)."""
    live, need = {v for v in outs if _is_var(v)}, set()
    for i in reversed(range(len(eqns))):
        if any(o in live for o in eqns[i].outvars):
            need.add(i)
            live |= {v for v in eqns[i].invars if _is_var(v)}
    return need


def layer_split(layer_fn, w_l, h, side, ct) -> LayerSplit:
    """The :class:`LayerSplit` of ``layer_fn`` at the abstract ``w_l`` (one layer), ``h`` (its input),
    ``side`` and ``ct`` (the cotangent of ``(y, float values)``)."""
    def residuals(ww, hh, sd):
        return jax.tree.leaves(_layer_vjp(layer_fn, ww, hh, sd)[1])

    res_jaxpr = jax.make_jaxpr(residuals)(w_l, h, side).jaxpr
    n_w = len(jax.tree.leaves(w_l))
    data = _depends(res_jaxpr, [False] * n_w + [True] * (len(res_jaxpr.invars) - n_w))
    res_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_jaxpr.outvars]
    box = {}

    def backward(res, c):  # the layer's VJP applied, from its residuals alone
        fn = _layer_vjp(layer_fn, w_l_zero(), jnp.zeros(h.shape, h.dtype), side_zero())[1]
        dw, dx = jax.tree.unflatten(jax.tree.structure(fn), res)(c)
        box["dw_tree"] = jax.tree.structure(dw)
        return jax.tree.leaves(dw), dx

    w_l_zero = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), w_l)  # noqa: E731  (dead code)
    side_zero = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), side)  # noqa: E731
    closed = jax.make_jaxpr(backward)(res_avals, ct)
    jaxpr, eqns = closed.jaxpr, closed.jaxpr.eqns
    dw_out, dx_out = jaxpr.outvars[:-1], jaxpr.outvars[-1:]
    b_set = _needed(eqns, dx_out)
    w_only = sorted(_needed(eqns, dw_out) - b_set)
    made_in_w = {o for i in w_only for o in eqns[i].outvars}
    kept = list(dict.fromkeys(v for v in [u for i in w_only for u in eqns[i].invars] + list(dw_out)
                              if _is_var(v) and v not in made_in_w and v not in set(jaxpr.constvars)))
    b_eqns = [eqns[i] for i in sorted(b_set | _needed(eqns, kept))]
    b_jaxpr = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, dx_out + kept, b_eqns,
                          jcore.join_effects(*(e.effects for e in b_eqns)),
                          debug_info=_resized_debug_info(jaxpr.debug_info, len(jaxpr.invars), 1 + len(kept)))
    w_eqns = [eqns[i] for i in w_only]
    w_jaxpr = jcore.Jaxpr(jaxpr.constvars, kept, dw_out, w_eqns, jcore.join_effects(*(e.effects for e in w_eqns)),
                          debug_info=_resized_debug_info(jaxpr.debug_info, len(kept), len(dw_out)))
    return LayerSplit(tuple(i for i, d in enumerate(data) if d), b_jaxpr, w_jaxpr, tuple(closed.consts),
                      tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in kept), box["dw_tree"])


def _resized_debug_info(info, n_in: int, n_out: int):
    """The backward's debug info resized to a half's inputs and outputs (names are not kept)."""
    if info is None:
        return None
    return info._replace(arg_names=(None,) * n_in if info.arg_names is not None else None,
                         result_paths=(None,) * n_out if info.result_paths is not None else None)


def _stage_b(layer_fn, split: LayerSplit):
    """One stage's input-gradient half: ``(w_k, x, side, ct, ct_v) -> (dx, kept)`` with ``kept`` (leading
    ``k``) what each layer's weight half reads."""

    def run(w_k, x, side, ct, ct_v):
        def fwd(h, w_l):
            (y, _), fn = _layer_vjp(layer_fn, w_l, h, side)
            leaves = jax.tree.leaves(fn)
            return y, [leaves[i] for i in split.data_res]

        def bwd(g, inp):
            w_l, res_l, ctv_l = inp
            # residuals made from the weights alone: recomputed (the rest of this forward is dead code)
            leaves = jax.tree.leaves(_layer_vjp(layer_fn, w_l, jnp.zeros_like(x), side)[1])
            for i, r in zip(split.data_res, res_l):
                leaves[i] = r
            out = jcore.eval_jaxpr(split.b_jaxpr, split.consts, *leaves, *jax.tree.leaves((g, ctv_l)))
            return out[0], out[1:]

        _, res = jax.lax.scan(fwd, x, w_k)
        return jax.lax.scan(bwd, ct, (w_k, res, ct_v), reverse=True)

    return run


def _stage_w(split: LayerSplit):
    """One stage's weight-gradient half: ``kept (leading k) -> dw_k``."""

    def run(kept):
        def body(_, kept_l):
            return None, jax.tree.unflatten(split.dw_tree, jcore.eval_jaxpr(split.w_jaxpr, split.consts, *kept_l))

        return jax.lax.scan(body, None, kept)[1]

    return run


def _stage_w_per_shard(split: LayerSplit, axes, d: int):
    """:func:`_stage_w` on each of the ``d`` row blocks of the kept values apart (leaves ``(k, rows, ...)``):
    weight gradients ``(d, k, ...)``, one per data shard."""
    run = _stage_w(split)

    def per_shard(kept):
        cut = [jax.vmap(lambda b: _cut_rows(b, d))(a) for a in kept]  # (k, rows, ...) -> (k, d, rows/d, ...)
        with batch_split_over(axes):
            return jax.vmap(run, in_axes=(1,), spmd_axis_name=axes)(cut)

    return per_shard


def zero_bubble(layer_fn, stack, x_m: jax.Array, side_m, head_loss, head_params, cfg: PipelineConfig,
                *, unroll: bool = False, head_inputs=None, dx_per_stage: bool = False):
    """The zero-bubble schedule: arguments and results as
    :func:`~meshtrain.parallel.pipeline.one_f_one_b` (``(loss_sum, aux_sum, d_stack, d_head_params,
    dx_m)``); the backward of each stage runs as an input-gradient tick and a deferred weight-gradient
    tick (module docstring). ``unroll``: Python tick loop (exact per-tick FLOPs in tests)."""
    s = _one_f_one_b_setup(layer_fn, stack, x_m, side_m, head_loss, head_params, cfg, split_rows=False,
                           head_inputs=head_inputs)
    p, m = s.p, s.m  # forward / B ticks: 1F1B's
    one = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), t)  # noqa: E731 (p,k,..)
    w_l, v_l = one(s.w), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _floats(s.v_shape))
    side_1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), side_m)
    h = jax.ShapeDtypeStruct(x_m.shape[1:], x_m.dtype)
    split = layer_split(layer_fn, w_l, h, side_1, (jax.ShapeDtypeStruct(s.y_shape.shape, s.y_shape.dtype), v_l))
    axes, d = _row_split(x_m.shape[1], s.v_shape, side_m)
    if d > 1 and all(a.shape and a.shape[0] == x_m.shape[1] for a in split.kept_avals):
        # every value W reads is per row: W runs on each data shard's rows apart and the weight gradients are
        # summed once after the ticks (as 1F1B's: one data-parallel reduction a step, not one per W tick)
        s = _one_f_one_b_setup(layer_fn, stack, x_m, side_m, head_loss, head_params, cfg, head_inputs=head_inputs)
    k = jax.tree.leaves(s.w)[0].shape[1]
    slots = p  # a micro-batch waits from its B (tick j+2p-2-s) to its W (tick j+2p-2): at most p in between
    carry0 = dict(s.carry0, wbuf=[_on_stage(jnp.zeros((p, slots + 1, k) + a.shape, a.dtype))  # + an idle slot
                                  for a in split.kept_avals])
    run_b = jax.vmap(_stage_b(layer_fn, split), spmd_axis_name=STAGE)
    run_w = jax.vmap(_stage_w(split) if s.rows_split == 1 else _stage_w_per_shard(split, s.row_axes, s.rows_split),
                     spmd_axis_name=STAGE)
    put = jax.vmap(lambda buf, i, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0))
    get = jax.vmap(lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False))
    bwd, wgt = s.bwd, jnp.asarray(schedule_table(Schedule.ZERO_BUBBLE, p, m).weight)

    def b_part(c, t, dy):
        c = dict(c)
        bmb = bwd[t]
        valid = bmb >= 0
        ct = jnp.where(_mask(s.last, c["bstate"]), dy.astype(c["bstate"].dtype), c["bstate"])  # dy (1 or p, ...)
        ct = jnp.where(_mask(valid, ct), ct, jnp.zeros_like(ct))
        ct_v = jax.tree.map(lambda buf, a: jnp.where(_mask(valid, buf), buf, 0).astype(a.dtype),
                            jax.tree.map(lambda buf: s.get_v(jnp.maximum(bmb, 0), s.stages, buf), c["dv"]),
                            _floats(s.v_shape))
        x_in = s.stash_get(c["stash"], jnp.maximum(bmb, 0) % s.slots)
        dx_t, kept = run_b(s.w, x_in, _pick(side_m, bmb), ct, ct_v)
        c["dx"] = _on_stage(jax.vmap(lambda buf, j, v: buf.at[j].add(v))(c["dx"], jnp.maximum(bmb, 0),
                                                                         dx_t.astype(jnp.float32)))
        c["bstate"] = _shift_back(dx_t)
        slot = jnp.where(valid, jnp.maximum(bmb, 0) % slots, slots)
        c["wbuf"] = [_on_stage(put(b, slot, v)) for b, v in zip(c["wbuf"], kept)]
        return c

    def w_part(c, t):
        c = dict(c)
        slot = jnp.maximum(wgt[t], 0) % slots  # the same micro-batch on every stage (ticks 2p-2 ..: one each)
        dw_t = run_w([get(b, slot) for b in c["wbuf"]])
        keep = _on_stage if s.rows_split == 1 else lambda a: _on_rows(a, s.row_axes)  # noqa: E731
        c["dw"] = jax.tree.map(lambda a, b: keep(s.add(a, b)), c["dw"], dw_t)
        return c

    s.carry0 = carry0
    return _run_ticks(s, _one_f_one_b_tick(s, x_m, side_m, head_loss, head_params, split_backward=(b_part, w_part)),
                      unroll, dx_per_stage)


def _shift_back(x: jax.Array) -> jax.Array:
    """Stage ``s`` gets stage ``s + 1``'s value (cotangents flow towards stage 0)."""
    return _on_stage(jnp.roll(x, -1, axis=0))

