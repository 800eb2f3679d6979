"""Abstract state: the shapes, dtypes and logical axes of a model and its optimizer, computed with
``eval_shape`` (no arrays are allocated, so this works for a 405B model on a laptop).

Example::

    abstract = abstract_state(lambda rngs: Decoder(get_config("tiny"), rngs=rngs), optax.adamw(1e-3))
    abstract.param_axes["embedder/embedding"]      # ('vocab', 'embed')

Next: :func:`meshtrain.make_plan` turns it into shardings for a recipe and mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.annotate import ModelRules, PathRules, current_step_context
from meshtrain.axes import LogicalAxes
from meshtrain.errors import RulesError
from meshtrain.precision import has_master_weights, master_weights

#: A model factory: takes ``nnx.Rngs`` and returns the model. ``lambda rngs: MyModel(cfg, rngs=rngs)``.
ModelFactory = Callable[[nnx.Rngs], nnx.Module]


class FrozenParam(nnx.Variable):
    """A weight that is planned and sharded like a parameter (its ``out_sharding`` names go through the
    parameter rules) but never trained: no gradient, no optimizer state. LoRA keeps the base model's
    weights in it (:mod:`meshtrain.models.lora`); the step carries it as model state, unchanged.

    Read inside a step (``w[...]``), a floating weight comes in the recipe's compute dtype, as the step casts
    the parameters: a bf16-stored base under an f32 step computes in f32, an f32 base under a bf16 step in bf16."""

    def __getitem__(self, index):
        value = super().__getitem__(index)
        ctx = current_step_context()
        compute = getattr(getattr(ctx, "resolved", None), "compute_dtype", None)
        if compute is not None and jnp.issubdtype(value.dtype, jnp.floating):
            return value.astype(compute)
        return value


def path_str(keypath) -> str:
    """``(DictKey('blocks'), DictKey('attn'), ...)`` → ``"blocks/attn/..."``."""
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def tree_paths(tree) -> Any:
    """A tree like ``tree`` whose leaves are their own path strings."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: path_str(kp), tree)


def paths_tree(tree):
    """``(leaves, treedef)`` of :func:`~meshtrain.abstract.tree_paths`: ``plan._map_paths`` rebuilds the tree
    ``jax.tree.map(lambda p: values[p], tree_paths(tree))`` makes."""
    return jax.tree_util.tree_flatten(tree_paths(tree))


@dataclasses.dataclass(frozen=True)
class AbstractState:
    """What a model + optimizer look like, without arrays.

    Attributes:
      graphdef: the model's structure (``nnx.merge(graphdef, params, model_state)`` rebuilds it).
      params: nested dict of ``jax.ShapeDtypeStruct`` (trainable ``nnx.Param`` leaves).
      param_axes: ``{path: logical axes}`` for every parameter.
      model_state: nested dict of non-parameter variables (batch statistics, RNG keys and counters).
      opt_state: ``jax.eval_shape(tx.init, params)``, or ``None`` without an optimizer.
      factory, tx, seed: what built it (``init_state`` re-runs the factory under ``jit``).
      model_state_axes: ``{path: logical axes}`` for the non-parameter variables that carry
        ``out_sharding`` metadata; the others are replicated.
    """

    graphdef: Any
    params: Any
    param_axes: Dict[str, LogicalAxes]
    model_state: Any
    opt_state: Any
    factory: ModelFactory
    tx: Optional[optax.GradientTransformation]
    model_state_axes: Dict[str, LogicalAxes] = dataclasses.field(default_factory=dict)
    #: the model rules' ``logical:`` section, ``((name, mesh axes), ...)``: :func:`meshtrain.make_plan` adds
    #: it to the recipe's parameter rules
    logical_rules: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    #: ``{path: names given}`` for parameters named with fewer logical names than dimensions (the
    #: trailing dimensions were padded with ``None``: unsharded, as JAX and Flax read a short spec)
    short_axes: Dict[str, int] = dataclasses.field(default_factory=dict)
    #: paths of the model state that are frozen weights (:class:`FrozenParam`: LoRA's base); the plan
    #: counts their bytes as ``base``
    frozen_paths: FrozenSet[str] = frozenset()

    # The flattened structures make_plan walks for every recipe and mesh (the planner plans one
    # abstract state many times): computed once per (immutable) state, dropped with it.
    @functools.cached_property
    def param_structure(self):
        """``([(path, leaf)], {path: shape}, paths tree)`` of the parameters."""
        flat = [(path_str(keypath), sds) for keypath, sds in jax.tree_util.tree_flatten_with_path(self.params)[0]]
        return flat, {path: tuple(sds.shape) for path, sds in flat}, paths_tree(self.params)

    @functools.cached_property
    def optimizer_structure(self):
        """``([(path, leaf, logical axes)], paths tree)`` of the optimizer state: a leaf that mirrors a
        parameter (same shape) takes its logical axes, any other (counts, scalars, factored moments) is
        replicated."""
        _, param_shape, _ = self.param_structure
        # Which parameter each optimizer leaf mirrors (None for counts and other non-param leaves).
        mirrors = optax.tree_utils.tree_map_params(
            self.tx, lambda _, p: p, self.opt_state, tree_paths(self.params),
            transform_non_params=lambda _: None, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        mirror_of = {path_str(kp): m for kp, m in jax.tree_util.tree_flatten_with_path(mirrors)[0]}
        flat = []
        for keypath, sds in jax.tree_util.tree_flatten_with_path(self.opt_state)[0]:
            path = path_str(keypath)
            param_path = mirror_of.get(path)
            if param_path is not None and tuple(sds.shape) == param_shape[param_path]:
                logical = self.param_axes[param_path]
            else:
                logical = (None,) * len(sds.shape)  # counts, scalars, factored moments: replicated
            flat.append((path, sds, logical))
        return flat, paths_tree(self.opt_state)

    @functools.cached_property
    def model_state_structure(self):
        """``([(path, leaf)], paths tree)`` of the non-parameter variables."""
        flat = [(path_str(keypath), sds)
                for keypath, sds in jax.tree_util.tree_flatten_with_path(self.model_state)[0]]
        return flat, paths_tree(self.model_state)

    @property
    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))

    @property
    def param_dtype(self):
        floats = {x.dtype for x in jax.tree.leaves(self.params) if jnp.issubdtype(x.dtype, jnp.floating)}
        return floats.pop() if len(floats) == 1 else None

    def with_optimizer(self, tx: optax.GradientTransformation) -> "AbstractState":
        """The same model with ``tx``'s state evaluated abstractly: what ``abstract_state(factory, tx)``
        returns, without building the model again (an optimizer chosen from the parameters' axes, as
        the Trainer's default one is, needs the model's state first)."""
        return dataclasses.replace(self, opt_state=jax.eval_shape(tx.init, self.params), tx=tx)

    def with_param_dtype(self, dtype) -> "AbstractState":
        """The same state with floating parameters stored as ``dtype`` (optimizer state re-derived).

        A 16-bit ``dtype`` wraps the optimizer in :func:`meshtrain.precision.master_weights`: the
        f32 master copy of the parameters lives in the optimizer state (sharded like it)."""
        dtype = jnp.dtype(dtype)
        if self.param_dtype == dtype:
            return self
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype)
                              if jnp.issubdtype(x.dtype, jnp.floating) else x, self.params)
        tx = self.tx
        if tx is not None and dtype.itemsize < 4 and not has_master_weights(self.opt_state):
            tx = master_weights(tx)
        opt_state = jax.eval_shape(tx.init, params) if tx is not None else None
        return dataclasses.replace(self, params=params, opt_state=opt_state, tx=tx)


def _build(factory: ModelFactory, seed) -> nnx.Module:
    # Eager sharding would need an active mesh; meshtrain shards through jit out_shardings instead.
    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(seed))
    if not isinstance(model, nnx.Module):
        raise RulesError(f"the model factory returned {type(model).__name__}; it must return an nnx.Module "
                         f"(e.g. `lambda rngs: MyModel(..., rngs=rngs)`)")
    return model


def split_model(model: nnx.Module):
    """``(graphdef, params pure dict, other variables pure dict)``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


#: What ``annotations=`` takes: rules (:class:`ModelRules`, :class:`PathRules`), a rules YAML file or a dict.
Annotations = Union[ModelRules, PathRules, Dict[str, Any], str, None]

#: An error lists this many offenders, then says how many more and where the full list is.
MAX_LISTED = 40
LIST_HINT = "`meshtrain plan --model ... --list-params` or meshtrain.list_params(factory) lists every parameter"


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter as the model builds it: ``names`` are its logical axes as given (``None``: none),
    ``source`` where they came from (``model``: its own metadata, ``rules``: a path rule, ``none``)."""

    path: str
    shape: Tuple[int, ...]
    dtype: str
    names: Optional[LogicalAxes]
    source: str
    #: ``params`` (trained) or ``model_state`` (non-parameter variables: batch statistics, RNG streams;
    #: named by ``out_sharding`` metadata or a path rule, else replicated)
    group: str = "params"

    def line(self) -> str:
        names = "(none)" if self.names is None else "(" + ", ".join(str(n) for n in self.names) + ")"
        return f"{self.path}  {self.shape}  {self.dtype}  {names}  [{self.source}]"


def model_rules(factory: ModelFactory, annotations: Annotations = None) -> Optional[ModelRules]:
    """``annotations`` first, then the rules the factory carries (``factory.model_rules``, as
    :func:`meshtrain.models.from_linen` sets it)."""
    given = ModelRules.load(annotations)
    own = getattr(factory, "model_rules", None)
    return given.combined(own) if given is not None else own


def listed(items: List[str], sep: str = ", ") -> str:
    """``items`` joined, at most :data:`MAX_LISTED` of them, then how many more and where to see them all."""
    shown = sep.join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return shown + (f"{sep}... and {more} more ({LIST_HINT})" if more > 0 else "")


def _param_infos(params_state, rules: Optional[ModelRules]) -> List[ParamInfo]:
    leaves = jax.tree_util.tree_flatten_with_path(params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    out = []
    for keypath, var in leaves:
        path = path_str(keypath)
        names, source = var.get_metadata().get("out_sharding"), "model"
        if names is None and rules is not None:
            names, source = rules.lookup(path), "rules"
        out.append(ParamInfo(path, tuple(var.shape), str(var.dtype), None if names is None else tuple(names),
                             source if names is not None else "none"))
    return out


def _state_infos(rest_state, rules: Optional[ModelRules]) -> List[ParamInfo]:
    """The model state's variables: logical names from their ``out_sharding`` metadata, else from a path rule
    (``paths: {'.*/normalization/(mean|var)': [mlp]}`` names BatchNorm statistics), else none (replicated).
    RNG streams (a key and a counter each) are never named by rules: they are scalars, replicated."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    out = []
    for keypath, var in jax.tree_util.tree_flatten_with_path(rest_state, is_leaf=is_var)[0]:
        if not isinstance(var, nnx.Variable):
            continue
        path = path_str(keypath)
        names, source = var.get_metadata().get("out_sharding"), "model"
        if isinstance(var, nnx.RngState):
            names, source = None, "rng stream: replicated"
        elif names is None and rules is not None:
            names, source = rules.lookup(path), "rules"
        source = source if names is not None or isinstance(var, nnx.RngState) else "replicated"
        out.append(ParamInfo(path, tuple(var.shape), str(var.dtype), None if names is None else tuple(names),
                             source, "model_state"))
    return out


def list_model_state(factory: ModelFactory, annotations: Annotations = None) -> List[ParamInfo]:
    """Every non-parameter variable of the model ``factory`` builds (BatchNorm statistics, RNG streams), with
    its path, shape, dtype and logical names (``group == "model_state"``): the state the train step carries and
    checkpoints, which path rules may shard like a parameter."""
    model = nnx.eval_shape(lambda: _build(factory, 0))
    _, _, rest_state = nnx.split(model, nnx.Param, ...)
    return _state_infos(rest_state, model_rules(factory, annotations))


def list_params(factory: ModelFactory, annotations: Annotations = None) -> List[ParamInfo]:
    """Every parameter of the model ``factory`` builds (abstractly: no arrays), with its path, shape, dtype
    and logical names: what path rules are written against. ``str(info.line())`` prints one."""
    model = nnx.eval_shape(lambda: _build(factory, 0))
    _, params_state, _ = nnx.split(model, nnx.Param, ...)
    return _param_infos(params_state, model_rules(factory, annotations))


def _param_axes(infos: List[ParamInfo]):
    """``({path: axes padded to the rank}, {path: names given, where fewer})``; raises listing every
    parameter without axes, and every one with more names than dimensions."""
    missing = [f"{i.path} {i.shape}" for i in infos if i.names is None]
    if missing:
        raise RulesError(
            f"{len(missing)} parameters without logical axes: " + listed(missing)
            + "; annotate them (nnx.with_partitioning(init, names)) or give path rules (annotations= / path_rules= "
              "/ --rules FILE.yaml with paths: {'REGEX': [embed, mlp]})")
    long = [f"{i.path} (shape {i.shape}, logical axes {i.names})" for i in infos if len(i.names) > len(i.shape)]
    if long:
        raise RulesError(f"{len(long)} parameters have more logical names than dimensions: " + listed(long)
                         + "; give at most one name (or None) per dimension")
    axes = {i.path: i.names + (None,) * (len(i.shape) - len(i.names)) for i in infos}
    short = {i.path: len(i.names) for i in infos if len(i.names) < len(i.shape)}
    return axes, short


def abstract_state(factory: ModelFactory, tx: Optional[optax.GradientTransformation] = None, *,
                   annotations: Annotations = None) -> AbstractState:
    """Evaluate ``factory`` and ``tx.init`` abstractly and collect every parameter's logical axes.

    Logical axes come from the parameter's ``out_sharding`` metadata
    (``nnx.with_partitioning(init, ("embed", "mlp"))`` or ``nnx.Param(..., out_sharding=...)``),
    else from ``annotations`` (a :class:`ModelRules` / :class:`PathRules`, a rules YAML file or a dict with
    ``paths:`` and ``logical:``), then from the rules the factory carries. A parameter with none raises,
    naming every such parameter. Fewer names than dimensions leave the trailing dimensions unsharded (as a
    short ``PartitionSpec`` does in JAX); the ``logical:`` rules travel to :func:`meshtrain.make_plan`.
    """
    rules = model_rules(factory, annotations)
    model = nnx.eval_shape(lambda: _build(factory, 0))
    graphdef, params_state, rest_state = nnx.split(model, nnx.Param, ...)
    axes, short = _param_axes(_param_infos(params_state, rules))
    state_axes: Dict[str, LogicalAxes] = {}
    for info in _state_infos(rest_state, rules):
        if info.names is None:
            continue
        if len(info.names) > len(info.shape):
            raise RulesError(f"model state {info.path!r} (shape {info.shape}) has logical axes {info.names} "
                             f"(from {info.source}) of rank {len(info.names)}; give at most one name (or None) "
                             f"per dimension")
        state_axes[info.path] = info.names + (None,) * (len(info.shape) - len(info.names))  # trailing: unsharded
    _, params, rest = split_model(model)
    opt_state = jax.eval_shape(tx.init, params) if tx is not None else None
    frozen = frozenset(path_str(k) for k, v in jax.tree_util.tree_flatten_with_path(
        rest_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0] if isinstance(v, FrozenParam))
    return AbstractState(graphdef, params, axes, rest, opt_state, factory, tx, state_axes,
                         rules.logical if rules is not None else (), short, frozen)
