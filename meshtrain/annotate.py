"""Logical names on activations and on models that carry none.

* :func:`constrain` is the one helper models call on activations::

      x_btd = constrain(x_btd, ("batch", "residual_seq", "embed"))

  Outside a meshtrain step (plain eager use, one device) it does nothing. Inside a step built by
  :func:`meshtrain.make_train_step` it resolves the names with the recipe's *activation* rules and
  applies ``jax.lax.with_sharding_constraint``.

* :class:`PathRules` names the axes of a model you did not write, by parameter path pattern::

      PathRules([(r".*attn.*kernel", ("embed", "heads")), (r".*bias", (None,))])

* :class:`ModelRules` adds the model's own logical names (``logical: {kv: null, joined_kv: tensor}``) and
  reads both sections from a YAML file or a dict (``--rules FILE.yaml``, ``TrainConfig(rules=...)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import jax

from meshtrain.axes import MESH_AXES, LogicalAxes
from meshtrain.errors import RulesError
from meshtrain.recipes import AttentionKind, LayerLoop, Remat, direct_layer_calls, load_yaml, resolve_layer_loop
from meshtrain.remat_policies import DEFAULT_OFFLOAD, checkpoint_policy
from meshtrain.rules import AxisRules
from meshtrain.strategies import Strategy

S = TypeVar("S", bound=Strategy)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step being traced tells the model and the kernels: the mesh and activation rules (for
    :func:`constrain`), the remat policy (for :func:`remat`), the attention kind, the layer loop and the
    recipe's dimensions with their options (``ctx.dimension(Context)``). Built by
    :func:`meshtrain.parallel.resolved.step_context_for` for the train step, the eval step and the planner alike."""

    mesh: jax.sharding.Mesh
    rules: AxisRules
    replicate_ok: frozenset = frozenset()
    remat: Remat = Remat.NONE
    attention: AttentionKind = AttentionKind.DENSE
    #: the recipe's dimensions (:class:`meshtrain.strategies.Strategy` objects with their options)
    strategies: Tuple[Strategy, ...] = ()
    layer_loop: LayerLoop = LayerLoop.AUTO
    scan_unroll: int = 1
    #: the plan's :class:`meshtrain.parallel.resolved.ResolvedStep` (``None`` for a context built by hand): the
    #: kernels run the attention it chose
    resolved: Optional[object] = None
    #: the activation names ``Remat.OFFLOAD`` keeps in host memory (the recipe's ``offload_activations``)
    offloaded: Tuple[str, ...] = DEFAULT_OFFLOAD
    #: mesh axes a surrounding ``jax.vmap(..., spmd_axis_name=axes)`` already splits the batch over (set by
    #: :func:`batch_split_over`): the constraints inside leave them out, as if they were of size 1
    split_axes: Tuple[str, ...] = ()

    def dimension(self, cls: Type[S]) -> Optional[S]:
        """The recipe's dimension of type ``cls`` (e.g. ``ctx.dimension(Context)``), or ``None``."""
        return next((s for s in self.strategies if isinstance(s, cls)), None)

    def mesh_sizes(self) -> Dict[str, int]:
        """``{mesh axis: size}`` that activation constraints resolve against: the mesh's, with the
        :attr:`split_axes` at 1 (a vmapped batch split already places them)."""
        return {a: 1 if a in self.split_axes else n for a, n in self.mesh.shape.items()}


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


@contextlib.contextmanager
def batch_split_over(axes: Tuple[str, ...]) -> Iterator[None]:
    """Trace a function that ``jax.vmap(..., spmd_axis_name=axes)`` maps over a split of the batch: its
    activation constraints leave ``axes`` out (the vmap puts its mapped dimension on them; naming them
    again would use a mesh axis twice). Example (the 1F1B backward's per-data-shard gradients)::

        with batch_split_over(("data",)):
            dw_d = jax.vmap(backward, spmd_axis_name=("data",))(x_rows_split)
    """
    ctx = _ACTIVE.get()
    token = _ACTIVE.set(dataclasses.replace(ctx, split_axes=ctx.split_axes + tuple(axes))) if ctx else None
    try:
        yield
    finally:
        if token is not None:
            _ACTIVE.reset(token)


_UNROLLED_AS_SCAN: contextvars.ContextVar[bool] = contextvars.ContextVar("meshtrain_unrolled_as_scan", default=False)


@contextlib.contextmanager
def unrolled_as_scan() -> Iterator[None]:
    """Trace a fully unrolled stack as ``lax.scan(unroll=n)`` instead of direct calls (:func:`scan_layers`).

    For the planner's traced residuals (:mod:`meshtrain.analysis`): the same arithmetic and the same residuals,
    but stacked per layer (``(L, ...)``), the shape its formulas read; the direct calls' per-layer weight slices
    would otherwise read as activations. Example: ``with unrolled_as_scan(): jax.make_jaxpr(residuals)(...)``."""
    token = _UNROLLED_AS_SCAN.set(True)
    try:
        yield
    finally:
        _UNROLLED_AS_SCAN.reset(token)


def remat(fn, policy: Optional[Remat] = None, *, prevent_cse: bool = False):
    """Wrap a layer function in ``jax.checkpoint`` with the recipe's remat policy.

    Call it on the body of your layer scan: ``body = meshtrain.remat(body)``. With ``Remat.NONE``
    (or outside a step) it returns ``fn`` unchanged. ``prevent_cse=False`` (the default) is right
    for a rolled ``lax.scan`` body; pass ``True`` when the calls end up in straight-line code
    (unrolled), or XLA merges the recomputation with the forward pass and nothing is saved
    (:func:`scan_layers` does this for you).
    """
    ctx = _ACTIVE.get()
    if policy is None:
        policy = ctx.remat if ctx is not None else Remat.NONE
    policy = Remat(policy)
    if policy is Remat.NONE:
        return fn
    offloaded = ctx.offloaded if ctx is not None else DEFAULT_OFFLOAD
    return jax.checkpoint(fn, policy=checkpoint_policy(policy, offloaded), prevent_cse=prevent_cse)


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
    body = remat(layer, prevent_cse=unroll > 1)
    # the step's decision (ResolvedStep.direct_layer_calls, which the planner reads too); a context built by hand
    # has no resolved step: its loop and remat, and any FP8 meta among the layers' leaves keeps the scan
    if ctx is None:
        direct = False
    elif ctx.resolved is not None:
        direct = ctx.resolved.direct_layer_calls(n)
    else:
        direct = direct_layer_calls(ctx.layer_loop, n, ctx.remat, ctx.scan_unroll) and not any(
            jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) for x in jax.tree.leaves(layers))
    if direct and not _UNROLLED_AS_SCAN.get():
        return _unrolled_layers(layer, carry, layers, n)
    return jax.lax.scan(body, carry, layers, length=length, unroll=unroll)


def _unrolled_layers(layer, carry, layers, n: int):
    """The stack as straight-line Python calls, layer ``i`` on ``layers[i]``; outputs stacked as a scan would.

    Why not ``lax.scan(unroll=n)``: its forward and its transposed (backward) loop each slice the stacked
    weights, so under FSDP the partitioner all-gathers every weight twice (XLA does not merge collectives).
    Called directly, the backward matmuls reuse the forward's gathered weight: ``small`` / ``fsdp`` on 8 CPU
    devices, 76 all-gathers of 24.3 MiB became 48 of 12.3 MiB, the same losses bit for bit
    (BENCHMARKS.md, "CPU step vs EasyDeL"). Only without remat: a remat policy wants the recomputation."""
    outs = []
    for i in range(n):
        # (an FP8 stack never comes here: its fp8_meta32 gradient has no transpose for slicing, so it stays a scan)
        carry, out = layer(carry, jax.tree.map(lambda x, i=i: jax.lax.index_in_dim(x, i, keepdims=False), layers))
        outs.append(out)
    return carry, jax.tree.map(lambda *xs: jax.lax.concatenate([jax.lax.expand_dims(x, (0,)) for x in xs], 0), *outs)


def activation_spec(logical: LogicalAxes, shape: Sequence[int], *, name: str = "activation"):
    """The ``PartitionSpec`` that :func:`constrain` would apply, or ``None`` outside a step."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return None
    return ctx.rules.resolve("activations", logical, shape, ctx.mesh_sizes(), path=name,
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

    def __init__(self, patterns=()):
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


RULES_SECTIONS = ("paths", "logical")


def _rules_error(source: str, where: str, text: str) -> RulesError:
    return RulesError(f"rules {source}: {where}: {text}")


def _path_entries(value, source: str):
    """``paths:`` as ``[(regex, names)]``: a mapping (YAML keeps its order) or a list of ``[regex, names]``."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        entries = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in value):
        entries = [tuple(e) for e in value]
    else:
        raise _rules_error(source, "paths", f"{value!r} is not a mapping; write `paths: {{'REGEX': [name, ...]}}` "
                                            f"(one logical name or null per dimension)")
    out = []
    for pattern, names in entries:
        if isinstance(names, str) or names is None:
            names = [names]
        if not isinstance(pattern, str) or not isinstance(names, (list, tuple)) or not all(
                n is None or isinstance(n, str) for n in names):
            raise _rules_error(source, f"paths.{pattern}", f"{names!r} is not a list of logical names; give one "
                                                           f"name (or null) per dimension, e.g. [embed, mlp]")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _rules_error(source, "paths", f"bad regular expression {pattern!r}: {exc}") from None
        out.append((pattern, tuple(names)))
    return out


def _logical_entries(value, source: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """``logical:`` as ``((name, mesh axes), ...)``; each target a mesh axis, a list of them, or null."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise _rules_error(source, "logical", f"{value!r} is not a mapping; write `logical: {{kv: null, "
                                              f"joined_kv: tensor}}`")
    out = []
    for name, target in value.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise _rules_error(source, "logical", f"{name!r} is not a logical axis name; use an identifier")
        axes = () if target is None else (target,) if isinstance(target, str) else target
        bad = [a for a in axes if a not in MESH_AXES] if isinstance(axes, (list, tuple)) else [axes]
        if bad:
            raise _rules_error(source, f"logical.{name}", f"{target!r} is not a mesh axis, a list of mesh axes or "
                                                          f"null; mesh axes: {', '.join(MESH_AXES)}")
        out.append((name, tuple(axes)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModelRules:
    """Rules for a model you did not write, from a YAML file or a dict with two sections::

        paths:                       # regex (re.fullmatch on "a/b/kernel") -> one logical name per dimension
          '.*/c_attn/kernel': [embed, joined_kv]
          '.*bias': [null]
        logical:                     # logical name -> mesh axis, list of mesh axes, or null (replicated)
          kv: null
          joined_kv: tensor

    ``paths`` give axes to parameters that have none (first match wins; fewer names than dimensions
    leave the trailing dimensions unsharded, as in JAX and Flax). ``logical`` maps the parameters'
    names, the model's own (``kv``) or meshtrain's (then it overrides the recipe's rule); a mesh axis
    that the recipe's mesh lacks is left out (a dp mesh has no ``tensor`` axis to split on).
    """

    paths: PathRules = PathRules(())
    logical: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    source: str = "dict"

    @classmethod
    def load(cls, spec: "ModelRules | PathRules | Mapping | str | os.PathLike | None") -> Optional["ModelRules"]:
        """A rules file path, a dict with ``paths``/``logical``, :class:`PathRules`, or ``None``."""
        if spec is None or isinstance(spec, ModelRules):
            return spec
        if isinstance(spec, PathRules):
            return cls(spec)
        source = "dict"
        if isinstance(spec, (str, os.PathLike)):
            source = os.fspath(spec)
            spec = _read_yaml(source)
        if not isinstance(spec, Mapping):
            raise _rules_error(source, "top level", f"a {type(spec).__name__}, not a mapping; give the sections "
                                                    f"{', '.join(RULES_SECTIONS)}")
        unknown = [k for k in spec if k not in RULES_SECTIONS]
        if unknown:
            raise _rules_error(source, "top level", f"unknown section {unknown[0]!r}; the sections are "
                                                    f"{', '.join(RULES_SECTIONS)}")
        return cls(PathRules(_path_entries(spec.get("paths"), source)), _logical_entries(spec.get("logical"), source),
                   source)

    def lookup(self, path: str) -> Optional[LogicalAxes]:
        return self.paths.lookup(path)

    def combined(self, other: Optional["ModelRules"]) -> "ModelRules":
        """These rules first, then ``other``'s (path patterns: first match wins; logical: ours win)."""
        if other is None:
            return self
        logical = dict(other.logical)
        logical.update(dict(self.logical))
        return ModelRules(PathRules(self.paths.patterns + other.paths.patterns), tuple(logical.items()),
                          f"{self.source} + {other.source}")


def _read_yaml(path: str):
    """The rules file's YAML (UTF-8, no key given twice: a second ``logical:`` would silently replace the
    first), through the loader recipe files use."""
    if not os.path.isfile(path):
        raise RulesError(f"rules file {path!r} does not exist; give a YAML file with sections paths: and logical:")
    return load_yaml(path, what="rules file", error=RulesError) or {}
