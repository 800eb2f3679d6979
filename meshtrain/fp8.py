"""FP8 dense matmuls with per-tensor scales (the recipe's ``fp8: delayed | current``).

Each dense matmul ``y = x · w`` a model routes through :func:`einsum` becomes, when the model was
built for FP8 (:func:`fp8_factory`), ``qdq(x, e4m3) · qdq(w, e4m3)`` with the output's gradient
passed through ``qdq(g, e5m2)`` on the way back: ``e4m3`` (``jnp.float8_e4m3fn``, max 448, 3
mantissa bits) for the forward inputs, ``e5m2`` (``jnp.float8_e5m2``, max 57344, 2 mantissa bits)
for gradients, whose range is wider. ``qdq`` = quantize to FP8 with a per-tensor scale, dequantize
back to the compute dtype: XLA:GPU rewrites ``convert(f8) → dot`` into one cuBLASLt FP8 GEMM
(``__cublas$lt$matmul$f8``); on CPU the converts stay and the dot runs in the compute dtype with
FP8-rounded values (the same numbers, for tests).

Scaling, per tensor (``scale = amax / fp8_max``):

* ``delayed``: the scale comes from the max of an amax history of the previous
  ``fp8_amax_history`` steps (the Transformer Engine's default recipe); this step's amax is pushed
  into the history. Flax's ``flax.linen.fp8_ops`` (``in_qdq``, ``out_qdq``) do it.
* ``current``: the scale comes from this tensor's own amax (one more reduction per input, no
  stale scale after a jump); the history has one entry (the last amax).

The scales and histories are model *state*: an :class:`Fp8Meta` variable (not an ``nnx.Param``),
so the plan places them (replicated; the layer stack's copies get the ``layers`` axis), checkpoints
keep them and a restore reshards them. Their new values leave the backward pass as the
"gradient" of these variables (flax's ``OVERWRITE_WITH_GRADIENT`` trick: the custom VJP returns the
updated scale and history instead of a derivative); :func:`value_and_grad` differentiates the loss
with respect to them too and *overwrites* them in the returned model state, so they never reach
the optimizer. Inside the step the meta is carried as flax's ``fm32`` dtype, whose autodiff "sum"
is a max: a layer run once per pipeline micro-batch gets the largest amax of all micro-batches.

What stays in the compute dtype, on purpose: attention scores and softmax (``exp`` of logits
needs range and precision FP8 does not have), norms (a mean of squares), the embedding lookup (a
gather, no matmul) and the output head (its logits feed the loss directly; Transformer Engine and
MaxText keep it in 16 bits too). The MoE router (f32) is not quantized; the experts' inputs and
weights are (see :func:`qdq_inputs`).

Example::

    factory = fp8_factory(model_factory("tiny"), Fp8.DELAYED, amax_history=1024)
    model = factory(nnx.Rngs(0))         # each dense layer holds an Fp8Dot of scales and histories
    y_btd = einsum("btf,fd->btd", h_btf, w_fd, model.blocks.mlp.fp8_down)   # inside the model
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax import lax

from meshtrain.errors import ConfigError
from meshtrain.recipes import Fp8, Schedule

E4M3 = jnp.float8_e4m3fn  #: forward inputs (weights and activations)
E5M2 = jnp.float8_e5m2    #: gradients
#: the meta's names in one :class:`Fp8Dot`, in order: (what, FP8 dtype)
ROLES = (("input", E4M3), ("kernel", E4M3), ("output_grad", E5M2))


class Fp8Meta(nnx.Variable):
    """A per-tensor FP8 scale ``(1,)`` or amax history ``(H,)``: model state that the train step
    overwrites with the value the backward pass computes (never an optimizer update)."""


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    """What :func:`fp8_factory` builds: the scaling ``mode`` and the amax ``history`` length
    (delayed; ``current`` keeps one entry)."""

    mode: Fp8
    history: int = 1024

    @property
    def history_len(self) -> int:
        return self.history if self.mode is Fp8.DELAYED else 1


_BUILDING: contextvars.ContextVar[Optional[Fp8Settings]] = contextvars.ContextVar("meshtrain_fp8", default=None)


@contextlib.contextmanager
def building(settings: Optional[Fp8Settings]):
    """Models built inside this context create :class:`Fp8Dot` meta for their dense matmuls."""
    token = _BUILDING.set(settings)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def fp8_factory(factory: Callable[[nnx.Rngs], nnx.Module], mode: "Fp8 | str", amax_history: int = 1024):
    """``factory`` building its model for FP8 (``mode`` ``none``: ``factory`` itself).

    Pass the recipe's ``fp8`` and ``fp8_amax_history``; wrap the factory before
    :func:`meshtrain.abstract_state` (the plan and every re-run of the factory, e.g. the sharded
    init, then see the scales). Example: ``fp8_factory(model_factory("small"), "delayed")``.
    """
    mode = Fp8(mode)
    if mode is Fp8.NONE:
        return factory
    settings = Fp8Settings(mode, int(amax_history))

    def build(rngs):
        with building(settings):
            return factory(rngs)

    build.fp8 = settings  # (readers: the factory was wrapped)
    on_base = getattr(factory, "build_on", None)
    if on_base is not None:  # LoRA (meshtrain.models.lora.LoRAFactory): --init-from's weights go on the base

        def build_on(rngs, base_params):
            with building(settings):
                return on_base(rngs, base_params)
        build.build_on = build_on
    return build


def recipe_factory(factory, recipe):
    """:func:`fp8_factory` with a recipe's ``fp8`` and ``fp8_amax_history``."""
    return fp8_factory(factory, getattr(recipe, "fp8", Fp8.NONE), getattr(recipe, "fp8_amax_history", 1024))


class Fp8Dot(nnx.Module):
    """The scales and amax histories of one FP8 matmul: its input, its kernel (weight) and its
    output's gradient. Tiny and replicated (logical axes ``(None,)``; ``layers`` in a stack)."""

    def __init__(self, settings: Fp8Settings):
        self.mode = settings.mode
        for role, _ in ROLES:
            setattr(self, f"{role}_scale", Fp8Meta(jnp.ones((1,), jnp.float32), out_sharding=(None,)))
            setattr(self, f"{role}_amax_history",
                    Fp8Meta(jnp.zeros((settings.history_len,), jnp.float32), out_sharding=(None,)))

    def meta(self, role: str):
        return getattr(self, f"{role}_scale")[...], getattr(self, f"{role}_amax_history")[...]


def dot_meta() -> Optional[Fp8Dot]:
    """For model constructors: an :class:`Fp8Dot` when the model is being built for FP8, else ``None``."""
    settings = _BUILDING.get()
    return None if settings is None or settings.mode is Fp8.NONE else Fp8Dot(settings)


# -- current scaling (flax's ops are delayed): this tensor's amax sets its scale --------------------
def _current_update(x, q_dtype, scale, history):
    is_fm32 = scale.dtype == fp8_ops.fm32
    if is_fm32:
        scale, history = lax.convert_element_type(scale, jnp.float32), lax.convert_element_type(history, jnp.float32)
    history = fp8_ops.compute_amax_history(x, history)
    scale = fp8_ops.compute_scale(history[0], scale, fp8_ops.get_fp8_max(q_dtype, jnp.float32))
    if is_fm32:
        scale, history = (lax.convert_element_type(v, fp8_ops.fp32_max_grad) for v in (scale, history))
    return scale, history


def _current_qdq(x, q_dtype, scale, history, compute_dtype):
    scale, history = _current_update(x, q_dtype, scale, history)
    return fp8_ops.qdq(x, q_dtype, fp8_ops._fm32_to_float32(scale), compute_dtype), scale, history


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def current_in_qdq(compute_dtype, q_dtype, x, scale, history):
    """``fp8_ops.in_qdq`` with current scaling."""
    return _current_qdq(x, q_dtype, scale, history, compute_dtype)[0]


def _cin_fwd(compute_dtype, q_dtype, x, scale, history):
    y, scale, history = _current_qdq(x, q_dtype, scale, history, compute_dtype)
    return y, (scale, history)


def _cin_bwd(compute_dtype, q_dtype, res, g):
    return (g,) + tuple(res)


current_in_qdq.defvjp(_cin_fwd, _cin_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def current_out_qdq(compute_dtype, q_dtype, y, scale, history):
    """``fp8_ops.out_qdq`` with current scaling (the gradient's own amax)."""
    return y


def _cout_fwd(compute_dtype, q_dtype, y, scale, history):
    return y, (scale, history)


def _cout_bwd(compute_dtype, q_dtype, res, g):
    return _current_qdq(g, q_dtype, res[0], res[1], compute_dtype)


current_out_qdq.defvjp(_cout_fwd, _cout_bwd)


def _ops(mode: Fp8):
    return (fp8_ops.in_qdq, fp8_ops.out_qdq) if mode is Fp8.DELAYED else (current_in_qdq, current_out_qdq)


# -- what models call ---------------------------------------------------------------------------
def qdq_inputs(meta: Optional[Fp8Dot], x, w):
    """``(x, w)`` quantize-dequantized to e4m3 with their per-tensor scales (``meta`` ``None``:
    unchanged). ``x`` is cast to ``w``'s dtype (the compute dtype)."""
    if meta is None:
        return x, w
    in_qdq, _ = _ops(meta.mode)
    x = x.astype(w.dtype)
    return (in_qdq(w.dtype, E4M3, x, *meta.meta("input")), in_qdq(w.dtype, E4M3, w, *meta.meta("kernel")))


def qdq_kernel(meta: Optional[Fp8Dot], w):
    """A weight alone quantize-dequantized to e4m3 (its input is quantized elsewhere or not at all)."""
    if meta is None:
        return w
    in_qdq, _ = _ops(meta.mode)
    return in_qdq(w.dtype, E4M3, w, *meta.meta("kernel"))


def qdq_output_grad(meta: Optional[Fp8Dot], y):
    """``y`` unchanged forward; its gradient quantize-dequantized to e5m2 (``meta`` ``None``: identity)."""
    if meta is None:
        return y
    _, out_qdq = _ops(meta.mode)
    return out_qdq(y.dtype, E5M2, y, *meta.meta("output_grad"))


def einsum(equation: str, x, w, meta: Optional[Fp8Dot]):
    """``jnp.einsum(equation, x, w)`` (``x`` an activation, ``w`` a weight); in FP8 when ``meta``
    is an :class:`Fp8Dot` (the model was built by :func:`fp8_factory`), else exactly the plain einsum.
    Example: ``einsum("btd,dnh->btnh", x_btd, self.wq_dnh[...], self.fp8_q)``."""
    if meta is None:
        return jnp.einsum(equation, x, w)
    x, w = qdq_inputs(meta, x, w)
    return qdq_output_grad(meta, jnp.einsum(equation, x, w))


# -- the train step: overwrite the meta with its "gradient" ---------------------------------------
def meta_paths(graphdef, params, model_state) -> Tuple[Tuple[str, ...], ...]:
    """The key paths of the :class:`Fp8Meta` leaves inside a model's pure-dict ``model_state``."""
    model = nnx.merge(graphdef, params, model_state)
    found = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
    return tuple(tuple(str(getattr(k, "key", k)) for k in kp)
                 for kp, _ in jax.tree_util.tree_leaves_with_path(found))


def _get(tree, path):
    for k in path:
        tree = tree[k if k in tree else int(k)]
    return tree


def _with(tree, path, value):
    """A copy of nested dict ``tree`` with ``path`` set to ``value`` (the other nodes shared)."""
    key = path[0] if path[0] in tree else int(path[0])
    out = dict(tree)
    out[key] = value if len(path) == 1 else _with(tree[key], path[1:], value)
    return out


def check_pipeline(paths, pipeline) -> None:
    """FP8 meta needs the autodiff pipelines with one layer group per stage (gpipe, circular with
    ``repeats=1``): 1F1B writes its own VJP (the meta would never update) and ``repeats > 1`` picks a
    stage's group with a gather, whose transpose cannot add the ``fm32`` meta."""
    if not paths or pipeline is None:
        return
    if pipeline.schedule.explicit_vjp or (pipeline.schedule is Schedule.CIRCULAR and pipeline.repeats > 1):
        raise ConfigError(f"fp8 with the pipeline schedule {pipeline.schedule.value} (repeats {pipeline.repeats}) "
                          f"is not supported: use schedule gpipe (or circular with repeats 1), or fp8 none")


def value_and_grad(summed: Callable, paths: Sequence[Tuple[str, ...]]):
    """``jax.value_and_grad(summed, has_aux=True)`` for the step's ``summed(params, model_state,
    batch) -> (loss, (weight, metrics, model_state))``, which also takes the "gradient" of the FP8
    meta at ``paths`` (:func:`meta_paths`) and writes it into the returned model state."""
    if not paths:
        return jax.value_and_grad(summed, has_aux=True)
    to_fm32 = partial(lax.convert_element_type, new_dtype=fp8_ops.fm32)
    to_f32 = partial(lax.convert_element_type, new_dtype=jnp.float32)

    def fn(params, model_state, batch):
        meta = [to_fm32(_get(model_state, p)) for p in paths]

        def loss(params, meta):
            ms = model_state
            for p, m in zip(paths, meta):
                ms = _with(ms, p, m)
            return summed(params, ms, batch)

        # vjp, not grad: grad refuses the fm32 (extended dtype) input
        total, pullback, (weight, metrics, new_state) = jax.vjp(loss, params, meta, has_aux=True)
        grads, new_meta = pullback(jnp.ones_like(total))
        for p, old, m in zip(paths, meta, new_meta):
            # a meta whose matmul did not reach the loss (or an unused role) gets fm32's zero (-inf): keep it
            m, old = to_f32(m), to_f32(old)
            new_state = _with(new_state, p, jnp.where(jnp.isfinite(m), m, old))
        return (total, (weight, metrics, new_state)), grads

    return fn
