"""The traced estimate of a step's activation memory, for a plan on an ``AbstractMesh`` (more devices
than exist, so nothing can be compiled): what the backward keeps per device, read off the loss's VJP
traced abstractly at one device's rows, and the working buffers the trace shows that XLA adds.

    saved_activation_bytes(plan, loss_fn)   # the residuals the backward keeps, per device
    traced_activations(plan, loss_fn)       # + tensor parallelism's all-reduce buffers, remat's recompute
    working_weight_bytes(plan)              # weights as multiplied (gathered over FSDP, cast)

Each rule here was read off XLA's buffer live ranges of real compiles (BENCHMARKS.md, "AbstractMesh
estimate against a compile"); every figure the plan prints says whether it is exact (plan), measured
(traced program) or extrapolated to the mesh (:func:`meshtrain.analysis.memory.program_memory`).
:mod:`meshtrain.analysis.compiled` uses it for ``program_cost`` on an ``AbstractMesh``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from meshtrain.abstract import path_str
from meshtrain.analysis.fusible import _CALLS, _FUSIBLE, _expands_on_the_way, _fusible, _fusion_roots
from meshtrain.analysis.gradient_buffers import first_gradient_bytes
from meshtrain.analysis.layout import layout_of
from meshtrain.analysis.weights_as_used import (_axes_in, _tensor_divisor, gathered_layer_bytes,  # noqa: F401
                                               tensor_split_sizes, working_weight_bytes)  # (re-exports)
from meshtrain.annotate import step_context, unrolled_as_scan
from meshtrain.parallel.resolved import batch_splits, step_context_for
from meshtrain.errors import ConfigError
from meshtrain.losses import unpack_loss
from meshtrain.precision import cast_floats


def _need_loss(loss_fn, what: str):
    if loss_fn is None:
        raise ConfigError(f"{what} of a model without analytic formulas needs its loss: pass loss_fn= "
                          f"(`meshtrain plan --loss module:fn`), a function (model, batch) -> (loss_sum, weight[, "
                          f"metrics])")
    return loss_fn



# -- activations (traced) -----------------------------------------------------------------------

def _nbytes(x) -> int:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return int(np.prod(x.shape)) * 8  # threefry keys: 2 × uint32
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _local_batch(plan, rows: int):
    def shrink(_, leaf):
        shape = list(leaf.shape)
        if leaf.batch_dim is not None:
            shape[leaf.batch_dim] = rows
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return plan.batch.map(shrink)


def _residuals(plan, loss_fn, rows: int, *, forward: bool = False):
    """The jaxpr whose outputs are the residuals of ``loss_fn``'s VJP for a ``rows``-row batch, traced on a
    1-device mesh (``jaxpr.outvars``: one per residual reference, a residual kept twice appears twice);
    ``forward``: the loss alone, not differentiated (its remat segments as the model wrote them)."""
    from flax import nnx


    abstract = plan.abstract.with_param_dtype(plan.recipe.param_dtype)
    names = tuple(plan.mesh.axis_names)
    mesh = jax.sharding.AbstractMesh((1,) * len(names), names)
    recipe = plan.recipe
    ctx = step_context_for(plan, mesh)  # the step meshtrain train runs, on a 1-device mesh
    dtype = jnp.dtype(recipe.compute_dtype)
    graphdef = abstract.graphdef

    def loss(params, model_state, batch):
        with step_context(ctx):
            model = nnx.merge(graphdef, cast_floats(params, dtype), model_state)
            return unpack_loss(loss_fn(model, batch), loss_fn)[0]

    forward = loss if forward else None

    def residuals(params, model_state, batch):
        out, vjp = jax.vjp(lambda p: loss(p, model_state, batch), params)
        return jax.tree.leaves(vjp), vjp(jnp.ones_like(out))  # the backward too: who reads each residual

    with jax.sharding.use_abstract_mesh(mesh), unrolled_as_scan():   # the layers' residuals stacked (L, ...)
        return jax.make_jaxpr(forward if forward else residuals)(
            abstract.params, abstract.model_state, _local_batch(plan, rows)).jaxpr


#: Consumers that take a fused producer as their input (a reduction's input fusion)
_FUSING_CONSUMERS = _FUSIBLE | {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}


def _read_only_by_fusions(jaxpr, var, start: int) -> bool:
    """Whether every reader of ``var`` from eqn ``start`` on (the backward) can fuse its producer: elementwise ops
    and reductions, looking into calls; a matmul, convolution or collective needs it in a buffer."""
    for e in jaxpr.eqns[start:]:
        for pos, x in enumerate(e.invars):
            if x is not var:
                continue
            name = e.primitive.name
            if name in _CALLS:
                inner = e.params.get("jaxpr") or e.params.get("call_jaxpr") or e.params.get("fun_jaxpr")
                inner = getattr(inner, "jaxpr", inner)
                if inner is None or pos >= len(inner.invars) or not _read_only_by_fusions(inner, inner.invars[pos], 0):
                    return False
            elif name not in _FUSING_CONSUMERS:
                return False
    return True


def _read_in(jaxpr, var, start: int) -> bool:
    """Whether an equation from ``start`` on reads ``var``, looking into calls: one a call passes on but its body
    never reads is dead there (XLA removes it), as a residual the backward does not need."""
    for e in jaxpr.eqns[start:]:
        for pos, x in enumerate(e.invars):
            if x is not var:
                continue
            inner = _sub_jaxprs(e) if e.primitive.name in _CALLS else []
            if len(inner) != 1 or pos >= len(inner[0].invars):
                return True
            body = inner[0]
            if body.invars[pos] in body.outvars or _read_in(body, body.invars[pos], 0):
                return True
    return False


def _stored_residuals(jaxpr, activations) -> list:
    """The residual variables (of ``activations``, output positions) XLA stores: each once, not the step's own
    inputs, and not those made by fusible ops from inputs, constants and the stored ones where the backward
    reads them only in fusions (XLA recomputes them there: e.g. a masked score matrix and its softmax from the
    scores, a causal mask from an iota); one a matmul reads stays in a buffer. Nor is one recomputed that a
    fusible op *expands* from smaller operands, or that has such an op on its fusible chain
    (:func:`~meshtrain.analysis.fusible._expands_on_the_way`: a layer norm's per-row statistic times its scale,
    an RMS norm's ``x / sqrt(mean(x²))``): XLA:CPU materialises such broadcasts where the backward's reductions
    read them (its YNNPACK library fusions take their operands from buffers), so at least one buffer of its size
    lives from the forward to the backward (flax's lm1b on 16 devices, the compiled step's live ranges: 1 per
    layer norm under fsdp_tp, 2 under dp, 3 under tp; T5 on 64 devices: each RMS norm's ``div``). A bool
    residual fused from one value the step does not keep otherwise counts as that value
    (:func:`~meshtrain.analysis.fusible._fusion_roots`: ReLU's mask is recomputed from the f32 pre-activation,
    which XLA keeps). Not counted: a residual the backward never reads (passed to a call whose body does not
    use it, as the masked scores of a softmax's backward: XLA removes it)."""
    producer = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    backward = 1 + max((producer.get(jaxpr.outvars[i], (-1,))[0] for i in activations), default=-1)
    live = set(jaxpr.invars) | set(jaxpr.constvars)
    stored: set = set()

    def kept(v) -> bool:
        return isinstance(v, Literal) or v in live or v in stored

    def derivable(v, depth: int) -> bool:
        if kept(v):
            return True
        found = producer.get(v)
        return (found is not None and depth > 0 and _fusible(found[1])
                and all(derivable(x, depth - 1) for x in found[1].invars))

    unique = {id(v): v for v in (jaxpr.outvars[i] for i in activations) if not isinstance(v, Literal)}
    for v in sorted(unique.values(), key=lambda v: producer.get(v, (-1,))[0]):
        found = producer.get(v)
        if v in live or not _read_in(jaxpr, v, backward):
            continue
        if (found is not None and _fusible(found[1]) and not _expands_on_the_way(v, producer, kept, 8)
                and _read_only_by_fusions(jaxpr, v, backward)):
            if all(derivable(x, 8) for x in found[1].invars):
                continue  # recomputed from what the step keeps anyway
            roots = _fusion_roots(v, producer, kept, 8)
            if len(roots) == 1 and v.aval.dtype == jnp.bool_:  # recomputed from the one value XLA keeps instead of it
                stored.update(roots)
                continue
        stored.add(v)
    return sorted(stored, key=lambda v: producer.get(v, (-1,))[0])


def local_rows(plan) -> int:
    """Rows of the global batch one device handles per micro-batch: ``B / (data-parallel × micro-batches)``."""
    return max(plan.batch.batch_size // (plan.data_parallel_size * batch_splits(plan.recipe)), 1)


def saved_activation_bytes(plan, loss_fn) -> int:
    """Bytes the backward keeps on one device for one micro-batch (``loss_fn``'s VJP residuals).

    The loss is traced abstractly (no devices) with the recipe's remat policy and compute dtype on
    ``B / (data-parallel size × micro-batches)`` rows. Each residual is counted once, not where the backward
    never reads it, and not where XLA recomputes it inside the backward's fusions (made by elementwise ops from
    the step's inputs, constants or the stored residuals, without expanding them: :func:`_stored_residuals`).
    It is traced twice, on ``b`` and ``b + 1`` rows: residuals whose shape changes with the rows are
    activations (counted); the others are weights and constants (not counted here: parameters are counted as
    parameters and gathered or cast weights as temporaries). Tensor parallelism: a residual with a dimension the plan
    splits over the tensor axes in some parameter (:func:`tensor_split_sizes`) is divided by the tensor size;
    context parallelism is not applied (an upper bound when ``context`` > 1)."""
    return traced_activations(plan, loss_fn).saved


@dataclasses.dataclass(frozen=True)
class TracedActivations:
    """What the loss's traced VJP says about one device's activation memory (bytes, one micro-batch).

    ``saved``: the residuals the backward keeps (:func:`saved_activation_bytes`), and under tensor parallelism
    the all-reduced partial sums they are fused from (:func:`_all_reduced_inputs`). ``working``: under tensor
    parallelism, what the backward's all-reduce buffers (a second buffer for each partial sum,
    :func:`_partial_sum`) add to its peak, the live bytes over the program's order
    (:func:`_backward_working_set`, with and without them); 0 without a tensor axis (XLA's other working
    buffers are not estimated: on one device's rows they stay within the saved residuals' error). ``recompute``:
    under remat, what the backward holds while it recomputes the largest remat segment
    (:func:`_recompute_working_set`); ``None`` without remat. ``gradient``: the first weight gradient the
    backward makes, at full size before its reduce-scatter, where the step keeps gradients split over the
    data-parallel axes (:func:`~meshtrain.analysis.gradient_buffers.first_gradient_bytes`; 0 otherwise)."""

    saved: int
    working: int
    recompute: Optional[int] = None
    gradient: int = 0


def traced_activations(plan, loss_fn) -> TracedActivations:
    """:class:`TracedActivations` of ``plan``'s step with ``loss_fn`` (traced on ``b`` and ``b + 1`` rows)."""
    loss_fn = _need_loss(loss_fn, "the activation estimate")
    b = local_rows(plan)
    one, two = _residuals(plan, loss_fn, b), _residuals(plan, loss_fn, b + 1)
    t, split, width = tensor_split_sizes(plan)
    outs, more = one.outvars, two.outvars
    if len(outs) == len(more):  # activations: the residuals whose shape follows the rows
        rows_of = _rows_of(one, two)
        picked = [i for i, (x, y) in enumerate(zip(outs, more)) if tuple(x.aval.shape) != tuple(y.aval.shape)]
    else:  # fallback: not a weight's shape
        params = {tuple(x.shape) for x in jax.tree.leaves(plan.abstract.params)}
        rows_of = {}
        picked = [i for i, x in enumerate(outs) if tuple(x.aval.shape) not in params]
    stored = _stored_residuals(one, picked)
    split = split | _head_counts(stored, rows_of, t, width)
    sizes = {v: _nbytes(v.aval) / _tensor_divisor(v.aval.shape, rows_of.get(id(v), ()), t, split) for v in stored}
    weights = _tensor_split_weights(plan, one) if t > 1 else {}
    saved = int(sum(sizes.values()) + _all_reduced_inputs(one, two, stored, t, split, weights))
    producer = {v: i for i, e in enumerate(one.eqns) for v in e.outvars}
    backward = 1 + max((producer.get(outs[i], -1) for i in picked), default=-1)
    working = 0.0
    if t > 1 and len(one.eqns) == len(two.eqns):  # what tensor parallelism's all-reduces add to the backward's peak
        working = (_backward_working_set(one, two, backward, t, split, sizes, weights, with_all_reduce=True)
                   - _backward_working_set(one, two, backward, t, split, sizes, weights))
    recompute = _recompute_working_set(plan, loss_fn, b, t, split) if _remat_bodies(one) else None
    if recompute is not None:  # the residuals the backward is done with before it recomputes a segment are freed
        recompute = max(recompute - int(_freed_before_remat(one, backward, sizes)), 0)
    n_params = len(jax.tree.leaves(plan.abstract.params))  # the VJP's last outputs: the gradients, in tree order
    gradient = first_gradient_bytes(plan, one, backward, one.outvars[len(outs) - n_params:])
    return TracedActivations(saved, int(working), recompute, gradient)


def _rows_of(jaxpr, more) -> dict:
    """``id(value) -> its shape on one more row`` for ``jaxpr``'s outputs and, where ``more`` (the same program
    traced on one more row) has the same equations, every value an equation makes (a residual may be stored as
    a value it is recomputed from: :func:`_fusion_roots`)."""
    found = {}
    if len(jaxpr.eqns) == len(more.eqns):
        found.update({id(x): y.aval.shape for e, f in zip(jaxpr.eqns, more.eqns) for x, y in zip(e.outvars, f.outvars)})
    found.update({id(x): y.aval.shape for x, y in zip(jaxpr.outvars, more.outvars)})
    return found


def _freed_before_remat(jaxpr, start: int, sizes) -> float:
    """Bytes of the stored residuals (``sizes``: residual → bytes) the backward (eqns from ``start`` on) reads
    for the last time before its first equation that runs a remat segment: freed when the recomputation runs
    (a final layer norm's residuals, read before the layer scan's backward)."""
    first = next((i for i, e in enumerate(jaxpr.eqns[start:], start)
                  if e.primitive.name in _REMAT or any(_remat_bodies(x) for x in _sub_jaxprs(e))), None)
    if first is None:
        return 0.0
    last = {}
    for i, e in enumerate(jaxpr.eqns[start:], start):
        for x in e.invars:
            if not isinstance(x, Literal) and x in sizes:
                last[x] = i
    return float(sum(size for v, size in sizes.items() if last.get(v, first) < first))


#: The remat primitive (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``) as jaxprs name it.
_REMAT = ("remat2", "checkpoint")


def _remat_bodies(jaxpr) -> list:
    """The bodies of the outermost remat segments ``jaxpr`` runs (looking into calls, scans and loops; a scan's
    body at one iteration's shapes), in program order."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name in _REMAT:
            found.extend(_sub_jaxprs(e)[:1])
        else:
            for inner in _sub_jaxprs(e):
                found.extend(_remat_bodies(inner))
    return found


def _segment_residuals(body):
    """The jaxpr of the residuals (and the backward) of a remat segment's body differentiated *without* its
    policy, as :func:`_residuals` traces the loss: what the backward recomputes and holds while it runs the
    segment's backward; and how many of its first outputs are the residuals (the rest: the input gradients).
    Differentiated in its floating inputs; the cotangent of each float output is ones."""
    run = jaxpr_as_fun(ClosedJaxpr(body, []))
    avals = [v.aval for v in body.invars]
    floats = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.inexact)]
    others = [i for i in range(len(avals)) if i not in floats]

    def residuals(diff, rest):
        def total(diff):
            args = [None] * len(avals)
            for i, x in zip(floats, diff):
                args[i] = x
            for i, x in zip(others, rest):
                args[i] = x
            outs = [o for o in run(*args) if jnp.issubdtype(o.dtype, jnp.inexact)]
            return sum((o.sum() for o in outs), jnp.zeros((), jnp.float32))
        out, vjp = jax.vjp(total, diff)
        return jax.tree.leaves(vjp), vjp(jnp.ones_like(out))

    shapes = lambda idx: [jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in idx]  # noqa: E731
    traced, out_shape = jax.make_jaxpr(residuals, return_shape=True)(shapes(floats), shapes(others))
    return traced.jaxpr, len(out_shape[0])


def _recompute_working_set(plan, loss_fn, b: int, t: int, split: frozenset) -> Optional[int]:
    """Bytes one device holds while the backward recomputes a remat segment (a layer under ``nn.remat`` or
    ``jax.checkpoint``, scanned or not): the segment's forward runs again next to its backward, keeping what the
    segment would save without remat. Measured: each remat segment of the traced forward (``b`` and ``b + 1``
    rows) differentiated without its policy (:func:`_segment_residuals`), its residuals counted as
    :func:`_stored_residuals` counts the step's, the activations among them ÷ the tensor size where split
    (:func:`_tensor_divisor`); the largest segment (one runs at a time). ``None`` without remat. What it adds to the
    peak is this less the step's residuals freed before the first segment's backward
    (:func:`_freed_before_remat`, in :func:`traced_activations`)."""
    one, two = (_remat_bodies(_residuals(plan, loss_fn, rows, forward=True)) for rows in (b, b + 1))
    if not one or len(one) != len(two):
        return None
    largest = 0.0
    for body, body_more in zip(one, two):
        (res, n), (res_more, n_more) = _segment_residuals(body), _segment_residuals(body_more)
        if n != n_more:
            continue
        rows_of = _rows_of(res, res_more)
        picked = [i for i, (x, y) in enumerate(zip(res.outvars[:n], res_more.outvars[:n]))
                  if tuple(x.aval.shape) != tuple(y.aval.shape)]
        stored = _stored_residuals(res, picked)
        largest = max(largest, sum(_nbytes(v.aval) / _tensor_divisor(v.aval.shape, rows_of.get(id(v), ()), t, split)
                                   for v in stored))
    return int(largest)


#: Elementwise primitives of a backward beyond :data:`_FUSIBLE` (cotangent sums, zeroed gradients): fused too.
_ELEMENTWISE = _FUSIBLE | {"add_any", "stop_gradient", "is_finite"}
_FUSED_READERS = _ELEMENTWISE | {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (a call's body, a scan's or while's body, a cond's branches)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns") and hasattr(inner, "outvars"):
                found.append(inner)
    return found


def _elementwise(eqn) -> bool:
    """Whether XLA fuses ``eqn`` into its readers (an elementwise primitive, or a call with only those inside)."""
    if eqn.primitive.name in _ELEMENTWISE:
        return True
    inner = _sub_jaxprs(eqn)
    return eqn.primitive.name in _CALLS and len(inner) == 1 and all(_elementwise(e) for e in inner[0].eqns)


def _partial_sum(eqn, more_eqn, t: int, split: frozenset, weights=None) -> bool:
    """Whether under tensor parallelism ``eqn`` is a matmul that sums over a dimension split over the tensor axes
    into an activation that is not split: each device computes a partial sum, all-reduced into a second buffer
    of the same size (``more_eqn``: the same equation traced on one more row). Split: a dimension of a
    tensor-split size, or one of a weight's dimensions the plan shards over the tensor axes (``weights``: weight
    variable → those dimensions, :func:`_tensor_split_weights`; e.g. a ``(D, D)`` output projection whose input
    dimension is the heads')."""
    if t <= 1 or eqn.primitive.name != "dot_general":
        return False
    (contract_l, contract_r), _ = eqn.params["dimension_numbers"]
    summed = [eqn.invars[0].aval.shape[d] for d in contract_l] + [eqn.invars[1].aval.shape[d] for d in contract_r]
    sharded = [d for x, dims in zip(eqn.invars, (contract_l, contract_r)) if not isinstance(x, Literal)
               for d in dims if d in (weights or {}).get(x, ())]
    out, out_more = eqn.outvars[0].aval.shape, more_eqn.outvars[0].aval.shape
    return (any(d in split for d in summed) or bool(sharded)) and _tensor_divisor(out, out_more, t, split) == 1


#: Shape-preserving ops a weight passes through on its way to a matmul (a cast, a copy): its sharded dims stay.
_SAME_DIMS = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint"})


def _tensor_split_weights(plan, jaxpr) -> Dict[Any, frozenset]:
    """The dimensions of each parameter (``jaxpr``'s first inputs, in the params' tree order) the plan shards
    over the tensor axes, and of the casts and transposes made of them (as the matmuls read them)."""
    axes = set(layout_of(plan).tensor_axes)
    spec = {leaf.path: leaf.spec for leaf in plan.group("params")}
    paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(plan.abstract.params)[0]]
    found = {}
    for var, path in zip(jaxpr.invars, paths):
        entries = tuple(spec.get(path, ())) + (None,) * len(getattr(var.aval, "shape", ()))
        dims = frozenset(i for i, e in enumerate(entries[:len(var.aval.shape)]) if _axes_in((e,)) & axes)
        if dims:
            found[var] = dims
    for e in jaxpr.eqns:
        if len(e.invars) != 1 or isinstance(e.invars[0], Literal) or e.invars[0] not in found:
            continue
        dims = found[e.invars[0]]
        if e.primitive.name in _SAME_DIMS:
            found[e.outvars[0]] = dims
        elif e.primitive.name == "transpose":
            perm = e.params["permutation"]
            found[e.outvars[0]] = frozenset(i for i, d in enumerate(perm) if d in dims)
    return found


def _all_reduced_inputs(jaxpr, more, stored, t: int, split: frozenset, weights=None) -> float:
    """Bytes of the all-reduced partial sums (:func:`_partial_sum`) the stored residuals are fused from (each
    once): under tensor parallelism the sum is a buffer of its own, which XLA keeps where the backward
    recomputes a residual from it (``x + attention_out`` from the all-reduced ``attention_out``)."""
    index = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    found: Dict[Any, float] = {}
    seen: set = set()

    def walk(v, depth: int):
        i = None if isinstance(v, Literal) else index.get(v)
        if i is None or v in seen or depth < 0:
            return
        seen.add(v)
        e = jaxpr.eqns[i]
        if _partial_sum(e, more.eqns[i], t, split, weights):
            found[v] = _nbytes(v.aval)
        elif _elementwise(e):
            for x in e.invars:
                walk(x, depth - 1)

    for v in stored:
        e = jaxpr.eqns[index[v]] if v in index else None
        if e is not None and _elementwise(e):
            for x in e.invars:
                walk(x, 8)
    return float(sum(found.values()))


def _backward_working_set(jaxpr, more, start: int, t: int, split: frozenset, saved=None, weights=None, *,
                          with_all_reduce: bool = False) -> float:
    """Bytes of the buffers the backward makes (eqns from ``start`` on) that are live at once, at the most.

    Counted: values whose shape follows the rows (``jaxpr`` traced on ``b`` rows, ``more`` on ``b + 1``; weight
    gradients are counted as gradients), each divided by the tensor size as :func:`_tensor_divisor` divides a
    residual, and only where XLA gives them a buffer: made by a non-elementwise op (a matmul, a reduction, a
    call) or read by one (a matmul reads its operands from memory); elementwise chains between are fused. A
    buffer lives from the op that makes it to the last op that reads it or a value fused from it. A call's or
    a scan's body adds its own working set while it runs. The residuals are not counted (they are the saved
    activations) but they are freed as the backward reads them for the last time: ``saved`` (residual → bytes)
    are live from ``start`` to their last reader, and the result is the most bytes live at once less their
    sum (what the backward needs beyond them, 0 when its peak is at its start). ``with_all_reduce``: each
    partial sum (:func:`_partial_sum`) has a second buffer, its all-reduce, as long as it lives. A body's own
    outputs are the call's buffers (not counted twice). Sequential order (the program's); an estimate of the
    heap, used for the difference the all-reduces make (:class:`TracedActivations`)."""
    eqns = jaxpr.eqns
    shape_more = {v: w.aval.shape for e, f in zip(eqns, more.eqns) for v, w in zip(e.outvars, f.outvars)}
    made = {v: i for i, e in enumerate(eqns) if i >= start for v in e.outvars}
    readers: Dict[Any, list] = {}
    for e in eqns[start:]:
        for x in e.invars:
            if not isinstance(x, Literal):
                readers.setdefault(x, []).append(e)
    outputs = {v for v in jaxpr.outvars if not isinstance(v, Literal)}

    def activation(v) -> bool:
        shape = getattr(v.aval, "shape", None)
        return shape is not None and tuple(shape) != tuple(shape_more.get(v, shape))

    buffers = {v for v, i in made.items() if activation(v) and (v not in outputs or start > 0) and (
        not _elementwise(eqns[i]) or v in outputs
        or any(r.primitive.name not in _FUSED_READERS and not _elementwise(r) for r in readers.get(v, ())))}
    roots: Dict[Any, frozenset] = {}

    saved = saved or {}
    producer = {v: e for e in eqns for v in e.outvars}

    def roots_of(v) -> frozenset:  # the buffers (or residuals) a fused value is computed from
        if isinstance(v, Literal):
            return frozenset()
        if v in buffers or v in saved:
            return frozenset({v})
        if v not in roots:
            e = producer.get(v)
            fused = e is not None and (v in made or _elementwise(e))
            roots[v] = frozenset().union(*(roots_of(x) for x in e.invars)) if fused else frozenset()
        return roots[v]

    made.update({v: start for v in saved})
    end = {v: made[v] for v in (buffers | set(saved))}
    for i, e in enumerate(eqns[start:], start):
        for x in e.invars:
            for r in roots_of(x):
                end[r] = max(end[r], i)
    for v in outputs & buffers:
        end[v] = len(eqns)
    live, reduced = [0.0] * (len(eqns) + 1), [0.0] * (len(eqns) + 1)
    for v in buffers | set(saved):
        size = saved[v] if v in saved else _nbytes(v.aval) / _tensor_divisor(v.aval.shape, shape_more[v], t, split)
        extra = size if v in buffers and _partial_sum(eqns[made[v]], more.eqns[made[v]], t, split, weights) else 0.0
        for i in range(made[v], end[v] + 1):
            live[i] += size
            reduced[i] += extra
    for i, (e, f) in enumerate(zip(eqns[start:], more.eqns[start:]), start):
        inner = [_backward_working_set(a, b, 0, t, split, with_all_reduce=True) for a, b
                 in zip(_sub_jaxprs(e), _sub_jaxprs(f)) if len(a.eqns) == len(b.eqns)]
        plain = [_backward_working_set(a, b, 0, t, split) for a, b
                 in zip(_sub_jaxprs(e), _sub_jaxprs(f)) if len(a.eqns) == len(b.eqns)]
        live[i] += max(plain, default=0.0)
        reduced[i] += max(inner, default=0.0) - max(plain, default=0.0)
    if with_all_reduce:
        live = [a + b for a, b in zip(live, reduced)]
    return max(max(live[start:], default=0.0) - sum(saved.values()), 0.0)


def _head_counts(stored, rows_of, t: int, width) -> frozenset:
    """Head counts the activations show: ``a`` of an activation's last two dimensions ``(a, h)`` (not the rows)
    whose product is the model width, as a ``(b, T, D)`` projection reshaped to ``(b, T, heads, head_dim)``
    (HF's q/k/v kernels are ``(D, D)`` with their output split over the tensor axes: the heads are no
    parameter dimension, yet the scores ``(b, heads, T, T)`` are split by them)."""
    if t <= 1 or not width:
        return frozenset()
    heads = set()
    for v in stored:
        shape, more = tuple(v.aval.shape), rows_of.get(id(v), ())
        dims = [d for i, d in enumerate(shape) if i >= len(more) or more[i] == d]  # not the rows
        if len(dims) >= 2 and dims[-2] > 1 and dims[-1] > 1 and dims[-2] * dims[-1] == width and dims[-2] % t == 0:
            heads.add(dims[-2])
    return frozenset(heads)
