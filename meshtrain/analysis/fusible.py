"""Which values of a traced step XLA fuses rather than keeps in a buffer: the elementwise primitives it fuses
into their consumers, and the shapes of fusion that decide whether a residual of the backward is recomputed
(made again inside the backward's fusions) or stored. :mod:`meshtrain.analysis.traced` counts the residuals
with these rules; each was read off XLA's buffers live at a compiled step's peak (BENCHMARKS.md)::

    _fusible(eqn)                                       # XLA fuses it into its readers
    _expands(eqn), _broadcasts(eqn)                     # it makes a larger value from smaller operands
    _expands_on_the_way(v, producer, kept, 8)           # some op on v's fusible chain does
    _fusion_roots(v, producer, kept, 8)                 # what XLA keeps to recompute v
"""

from __future__ import annotations

import numpy as np
from jax.extend.core import Literal


#: Primitives XLA fuses into their consumers (elementwise, broadcasts, reshapes, converts, index ramps): a
#: residual made by these from values the step keeps anyway is recomputed where the backward reads it, not stored.
_FUSIBLE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "clamp", "convert_element_type", "copy", "copy_p", "cos", "div", "eq",
    "erf", "exp", "exp2", "expand_dims", "ge", "gt", "integer_pow", "iota", "le", "log", "log1p", "logistic", "lt",
    "max", "min", "mul", "ne", "neg", "not", "or", "pow", "reshape", "rsqrt", "select_n", "sign", "sin", "sqrt",
    "square", "squeeze", "sub", "tanh", "transpose", "xor"})
_CALLS = ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "closed_call")


def _fusible(eqn) -> bool:
    """Whether XLA fuses ``eqn`` into its consumers: a fusible primitive, or a call whose body has only those."""
    name = eqn.primitive.name
    if name in _FUSIBLE:
        return True
    if name in _CALLS:
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and all(_fusible(e) for e in inner.eqns)
    return False


def _expands(eqn) -> bool:
    """Whether ``eqn`` makes a value larger than each of its operands, at least one of them computed (not a
    literal): an outer product or broadcast, e.g. a layer norm's ``rsqrt(var)[..., None] * scale`` of shape
    ``(b, T, D)`` from a ``(b, T, 1)`` statistic and a ``(D,)`` weight."""
    size = int(np.prod(eqn.outvars[0].aval.shape)) if eqn.outvars else 0
    computed = [x for x in eqn.invars if not isinstance(x, Literal)]
    return bool(computed) and all(int(np.prod(getattr(x.aval, "shape", ()))) < size for x in computed)


def _broadcasts(eqn) -> bool:
    """Whether ``eqn`` broadcasts a smaller computed operand into its larger output (``x / sqrt(var)`` of a
    ``(b, T, D)`` value by a ``(b, T, 1)`` statistic: JAX binds the size-1 dimensions without a separate
    ``broadcast_in_dim``)."""
    size = int(np.prod(eqn.outvars[0].aval.shape)) if eqn.outvars else 0
    return size > 1 and any(int(np.prod(getattr(x.aval, "shape", ()))) < size
                            for x in eqn.invars if not isinstance(x, Literal))


def _expands_on_the_way(v, producer, kept, depth: int) -> bool:
    """Whether a fusible op that *expands* (:func:`_expands`) or broadcasts (:func:`_broadcasts`) makes ``v`` or a
    value it is fused from, up to the values the step keeps (``kept``): RMSNorm's ``x / sqrt(mean(x²))`` divides
    by a broadcast per-row statistic, which XLA:CPU materialises (T5 under fsdp on 64 devices: every layer norm's
    ``div`` is a live ``f32[b, T, D]`` buffer at the peak, next to its ``mul`` by the weight)."""
    found = None if isinstance(v, Literal) else producer.get(v)
    if found is None or depth < 0 or not _fusible(found[1]):
        return False
    if _expands(found[1]) or _broadcasts(found[1]):
        return True
    return any(not kept(x) and _expands_on_the_way(x, producer, kept, depth - 1) for x in found[1].invars)


def _fusion_roots(v, producer, kept, depth: int) -> set:
    """The values a fusible residual ``v`` is computed from that the step does not keep already (``kept``): the
    first non-fusible producers (a matmul's output) up its chain of fusible ops. XLA fuses a residual the
    backward reads only in fusions into those readers and keeps one such value instead of the residual:
    ReLU's mask ``x > 0`` (bool) is recomputed from the pre-activation ``x`` (f32), which lives to the backward
    (T5's ``wi`` outputs at the peak of its step under fsdp on 64 devices). A residual fused from two or more
    (a residual stream ``x + attention_out``) is stored itself (:func:`meshtrain.analysis.traced._stored_residuals`)."""
    if kept(v):
        return set()
    found = producer.get(v)
    if found is None or depth <= 0 or not _fusible(found[1]):
        return {v}
    return set().union(*(_fusion_roots(x, producer, kept, depth - 1) for x in found[1].invars))
