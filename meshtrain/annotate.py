"""Logical names on activations and on models that carry none.

* :func:`constrain` is the one helper models call on activations::

      x_btd = constrain(x_btd, ("batch", "residual_seq", "embed"))

  Outside a meshtrain step (plain eager use, one device) it does nothing. Inside a step built by
  :func:`meshtrain.make_train_step` it resolves the names with the recipe's *activation* rules and
  applies ``jax.lax.with_sharding_constraint``.

* :class:`PathRules` names the axes of a model you did not write, by parameter path pattern::

      PathRules([(r".*attn.*kernel", ("embed", "heads")), (r".*bias", (None,))])
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Iterator, Optional, Sequence, Tuple, Type, TypeVar

import jax

from meshtrain.axes import LogicalAxes
from meshtrain.errors import RulesError
from meshtrain.recipes import AttentionKind, LayerLoop, Remat, resolve_layer_loop
from meshtrain.rules import AxisRules
from meshtrain.strategies import Strategy

S = TypeVar("S", bound=Strategy)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step being traced tells the model and the kernels: the mesh and activation rules (for
    :func:`constrain`), the remat policy (for :func:`remat`), the attention kind, the layer loop and the
    recipe's dimensions with their options (``ctx.dimension(Context)``). Built by
    :func:`step_context_for` for the train step, the eval step and the planner alike."""

    mesh: jax.sharding.Mesh
    rules: AxisRules
    replicate_ok: frozenset = frozenset()
    remat: Remat = Remat.NONE
    attention: AttentionKind = AttentionKind.DENSE
    #: the recipe's dimensions (:class:`meshtrain.strategies.Strategy` objects with their options)
    strategies: Tuple[Strategy, ...] = ()
    layer_loop: LayerLoop = LayerLoop.AUTO
    scan_unroll: int = 1

    def dimension(self, cls: Type[S]) -> Optional[S]:
        """The recipe's dimension of type ``cls`` (e.g. ``ctx.dimension(Context)``), or ``None``."""
        return next((s for s in self.strategies if isinstance(s, cls)), None)


def step_context_for(plan, mesh: Optional[jax.sharding.Mesh] = None) -> StepContext:
    """The one step context of ``plan`` (its recipe's knobs and dimensions, rules and mesh); ``mesh``
    replaces the plan's (the planner traces on a 1-device abstract mesh)."""
    r = plan.recipe
    return StepContext(plan.mesh if mesh is None else mesh, plan.rules, frozenset(r.replicate_indivisible), r.remat,
                       r.attention, tuple(r.strategies), r.layer_loop, r.scan_unroll)


_ACTIVE: contextvars.ContextVar[Optional[StepContext]] = contextvars.ContextVar("meshtrain_step", default=None)


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    """Make ``ctx`` active while tracing a step (``make_train_step`` does this for you)."""
    token = _ACTIVE.set(ctx)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_step_context() -> Optional[StepContext]:
    return _ACTIVE.get()


_POLICIES = {
    Remat.FULL: jax.checkpoint_policies.nothing_saveable,
    Remat.DOTS: jax.checkpoint_policies.checkpoint_dots,
    Remat.DOTS_NO_BATCH: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat(fn, policy: Optional[Remat] = None, *, prevent_cse: bool = False):
    """Wrap a layer function in ``jax.checkpoint`` with the recipe's remat policy.

    Call it on the body of your layer scan: ``body = meshtrain.remat(body)``. With ``Remat.NONE``
    (or outside a step) it returns ``fn`` unchanged. ``prevent_cse=False`` (the default) is right
    for a rolled ``lax.scan`` body; pass ``True`` when the calls end up in straight-line code
    (unrolled), or XLA merges the recomputation with the forward pass and nothing is saved
    (:func:`scan_layers` does this for you).
    """
    if policy is None:
        ctx = _ACTIVE.get()
        policy = ctx.remat if ctx is not None else Remat.NONE
    policy = Remat(policy)
    if policy is Remat.NONE:
        return fn
    return jax.checkpoint(fn, policy=_POLICIES[policy], prevent_cse=prevent_cse)


def scan_layers(layer, carry, layers, *, length: Optional[int] = None):
    """Run ``layer(carry, layer_params) -> (carry, out)`` over the stacked ``layers`` (leading
    ``layers`` axis) with the recipe's remat policy and layer loop (:class:`LayerLoop`): a
    ``lax.scan``, fully unrolled, or ``scan_unroll`` layers per iteration; ``auto`` unrolls stacks of
    at most ``AUTO_UNROLL_LAYERS`` layers without remat (remat saves memory only inside a loop) and
    scans the rest. Outside a step it scans. Example::

        x_btd, _ = scan_layers(lambda x, p: (block(p, x), None), x_btd, stacked_params)
    """
    n = length if length is not None else jax.tree.leaves(layers)[0].shape[0]
    ctx = _ACTIVE.get()
    # auto: unrolled for shallow stacks without remat, else scanned (resolve_layer_loop says why)
    _, unroll = (resolve_layer_loop(ctx.layer_loop, n, ctx.remat, ctx.scan_unroll) if ctx is not None
                 else (LayerLoop.SCAN, 1))
    # Unrolled layers are straight-line code: keep XLA from merging the remat recomputation back
    # into the forward pass (measured: remat=full saved nothing unrolled with prevent_cse=False).
    return jax.lax.scan(remat(layer, prevent_cse=unroll > 1), carry, layers, length=length, unroll=unroll)


def activation_spec(logical: LogicalAxes, shape: Sequence[int], *, name: str = "activation"):
    """The ``PartitionSpec`` that :func:`constrain` would apply, or ``None`` outside a step."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return None
    return ctx.rules.resolve("activations", logical, shape, dict(ctx.mesh.shape), path=name,
                             replicate_ok=ctx.replicate_ok).spec


def target_platform() -> str:
    """The platform the active step is compiled *for*: its mesh's devices' (``tpu`` for a fake TPU
    topology compiled on a CPU host, ``gpu`` for an XLA:GPU target), else JAX's default backend.
    Kernels choose their implementation by it, never by the host they are traced on."""
    ctx = _ACTIVE.get()
    mesh = ctx.mesh if ctx is not None else None
    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def constrain(x: jax.Array, logical: LogicalAxes, *, name: str = "activation") -> jax.Array:
    """Constrain activation ``x`` to the layout its logical axes map to (no-op outside a step)."""
    spec = activation_spec(logical, x.shape, name=name)
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(_ACTIVE.get().mesh, spec))


@dataclasses.dataclass(frozen=True)
class PathRules:
    """Logical axes for parameters by path pattern (``re.fullmatch`` on ``"a/b/kernel"``), first
    match wins. Used for parameters without ``out_sharding`` metadata; a parameter that has
    metadata keeps it. Pass to :func:`meshtrain.abstract_state` (``annotations=``).
    """

    patterns: Tuple[Tuple[str, LogicalAxes], ...]

    def __init__(self, patterns):
        compiled = []
        for pattern, axes in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise RulesError(f"bad path pattern {pattern!r}: {exc}") from None
            compiled.append((pattern, tuple(axes)))
        object.__setattr__(self, "patterns", tuple(compiled))

    def lookup(self, path: str) -> Optional[LogicalAxes]:
        for pattern, axes in self.patterns:
            if re.fullmatch(pattern, path):
                return axes
        return None
