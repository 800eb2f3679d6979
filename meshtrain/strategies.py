"""Strategies: one parallelism dimension each, registered by name, composed into recipes.

A strategy claims the mesh axes it owns and contributes logical → mesh rules. Composition is
strict: two strategies claiming one mesh axis is an error, a strategy whose requirements are
missing is an error, and rules for the same logical name from different strategies concatenate in
canonical mesh order (``dp``'s ``batch -> data`` plus ``fsdp``'s ``batch -> fsdp`` gives
``batch -> (data, fsdp)``).

A strategy may also set *step options* (:data:`STEP_OPTIONS`) that the train step reads, so a
recipe's layout and its step cannot disagree: ``zero2`` sets ``shard_gradients`` (the step
constrains each gradient to its parameter's optimizer-state sharding before the update).

Add your own::

    @register_strategy("my_sp", "sequence sharding of the residual stream", requires=("tp",))
    def _my_sp() -> AxisRules:
        return AxisRules.of(activations={"residual_seq": "tensor"})
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from meshtrain.axes import LOGICAL_AXES, MESH_AXES
from meshtrain.errors import RecipeError
from meshtrain.rules import TABLES, AxisRules, Rule


#: Step options a strategy may set, with their meaning (the step reads them through
#: :func:`step_options`):
#:
#: * ``shard_gradients``: keep each gradient sharded like its parameter's optimizer state from the
#:   backward pass to the update (ZeRO-2: reduce-scatter instead of all-reduce; the updated
#:   parameters are all-gathered back to their own sharding).
STEP_OPTIONS: Dict[str, str] = {
    "shard_gradients": "gradients constrained to the optimizer-state sharding of their parameter (ZeRO-2)",
}


def register_step_option(name: str, meaning: str) -> None:
    """Declare a step option that strategies may set (kernels read it from the step context with
    ``current_step_context().option(name)``). Example::

        register_step_option("moe_dispatch", "how MoE tokens reach their experts")
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise RecipeError(f"step option name {name!r}: use an identifier such as 'moe_dispatch'")
    STEP_OPTIONS.setdefault(name, meaning)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A registered parallelism dimension: the mesh axes it owns, the rules it adds and the step
    options (:data:`STEP_OPTIONS`) it sets."""

    name: str
    description: str
    claims: Tuple[str, ...]
    rules: Callable[[], AxisRules]
    requires: Tuple[str, ...] = ()
    options: Tuple[Tuple[str, Any], ...] = ()


_STRATEGIES: Dict[str, Strategy] = {}


def register_strategy(name: str, description: str, *, claims: Iterable[str] = (), requires: Iterable[str] = (),
                      options: Optional[Mapping[str, Any]] = None):
    """Decorator: register ``fn() -> AxisRules`` as strategy ``name`` owning mesh axes ``claims`` and
    setting step ``options`` (names from :data:`STEP_OPTIONS`)."""

    def wrap(fn: Callable[[], AxisRules]):
        bad = [a for a in claims if a not in MESH_AXES]
        if bad:
            raise RecipeError(f"strategy {name!r} claims unknown mesh axes {bad}; use {MESH_AXES}")
        unknown = sorted(set(options or {}) - set(STEP_OPTIONS))
        if unknown:
            raise RecipeError(f"strategy {name!r} sets unknown step options {unknown}; known: {sorted(STEP_OPTIONS)}")
        _STRATEGIES[name] = Strategy(name, description, tuple(claims), fn, tuple(requires),
                                     tuple(sorted((options or {}).items())))
        return fn

    return wrap


def get_strategy(name: str) -> Strategy:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise RecipeError(f"unknown strategy {name!r}; registered: {', '.join(sorted(_STRATEGIES))}") from None


def strategies() -> Dict[str, Strategy]:
    return dict(_STRATEGIES)


#: compose() / step_options() results by (names, the registered Strategy objects, logical axes known):
#: pure functions of those, and recipes call them on every copy (the planner makes thousands).
_COMPOSED: Dict[Tuple, Tuple[AxisRules, Dict[str, str]]] = {}
_OPTIONS: Dict[Tuple, Dict[str, Any]] = {}


def _cache_key(names: Tuple[str, ...]):
    try:
        return names, tuple(_STRATEGIES[n] for n in names), tuple(LOGICAL_AXES)
    except KeyError:  # an unknown name: not cached, the uncached path raises the error
        return None


def compose(names: Iterable[str]) -> Tuple[AxisRules, Dict[str, str]]:
    """Compose strategies into (rules on top of the defaults, mesh axis -> owning strategy)."""
    names = tuple(names)
    key = _cache_key(names)
    try:
        hit = _COMPOSED.get(key) if key is not None else None
    except TypeError:  # a strategy with unhashable options
        key, hit = None, None
    if hit is None:
        hit = _compose(names)
        if key is not None:
            _COMPOSED[key] = hit
    rules, owners = hit
    return rules, dict(owners)


def _compose(names: Tuple[str, ...]) -> Tuple[AxisRules, Dict[str, str]]:
    owners: Dict[str, str] = {}
    for name in names:
        strat = get_strategy(name)
        missing = [r for r in strat.requires if r not in names]
        if missing:
            raise RecipeError(f"strategy {name!r} needs {missing} in the same recipe (it shards over their axes)")
        for axis in strat.claims:
            if axis in owners:
                raise RecipeError(
                    f"mesh axis {axis!r} is claimed by both {owners[axis]!r} and {name!r}; a mesh axis serves "
                    f"one purpose, drop one of the strategies")
            owners[axis] = name
    tables: Dict[str, Dict[str, Rule]] = {k: {} for k in TABLES}
    for name in names:
        rules = get_strategy(name).rules()
        for kind in TABLES:
            for rule in getattr(rules, kind):
                old = tables[kind].get(rule.logical)
                if old is None:
                    tables[kind][rule.logical] = Rule(rule.logical, rule.mesh_axes, name)
                    continue
                axes = sorted(set(old.mesh_axes) | set(rule.mesh_axes), key=MESH_AXES.index)
                tables[kind][rule.logical] = Rule(rule.logical, tuple(axes), f"{old.source}+{name}")
    composed = AxisRules(**{k: tuple(v.values()) for k, v in tables.items()})
    return AxisRules.defaults().merged(composed), owners


def step_options(names: Iterable[str]) -> Dict[str, Any]:
    """The step options the strategies ``names`` set together; two strategies setting one option to
    different values is an error naming both."""
    names = tuple(names)
    key = _cache_key(names)
    try:
        hit = _OPTIONS.get(key) if key is not None else None
    except TypeError:
        key, hit = None, None
    if hit is None:
        hit = _step_options(names)
        if key is not None:
            _OPTIONS[key] = hit
    return dict(hit)


def _step_options(names: Tuple[str, ...]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    setter: Dict[str, str] = {}
    for name in names:
        for key, value in get_strategy(name).options:
            if key in out and out[key] != value:
                raise RecipeError(f"step option {key!r} is set to {out[key]!r} by {setter[key]!r} and to {value!r} by "
                                  f"{name!r}; drop one of the strategies")
            out[key], setter[key] = value, name
    return out


# ---- built-in strategies -------------------------------------------------------------------

@register_strategy("dp", "data parallelism: batch split over `data`, weights replicated, gradients all-reduced",
                   claims=("data",))
def _dp() -> AxisRules:
    return AxisRules.of(activations={"batch": "data"})


@register_strategy("fsdp", "ZeRO-3: weights, gradients and optimizer state sharded over `fsdp` (on `embed`); "
                   "batch split over `fsdp`; weights all-gathered per layer", claims=("fsdp",))
def _fsdp() -> AxisRules:
    return AxisRules.of(params={"embed": "fsdp"}, activations={"batch": "fsdp"})


@register_strategy("zero1", "ZeRO-1: data parallelism with only the optimizer state sharded over `data`",
                   claims=("data",))
def _zero1() -> AxisRules:
    return AxisRules.of(activations={"batch": "data"}, optimizer={"embed": "data"})


@register_strategy("zero2", "ZeRO-2: data parallelism with the optimizer state and the gradients sharded over `data` "
                   "(gradients reduce-scattered, updated weights all-gathered)", claims=("data",),
                   options={"shard_gradients": True})
def _zero2() -> AxisRules:
    return AxisRules.of(activations={"batch": "data"}, optimizer={"embed": "data"})


@register_strategy("hsdp", "hybrid sharded DP: FSDP within `fsdp` groups, replicas across `data` (the DCN axis)",
                   claims=("data", "fsdp"))
def _hsdp() -> AxisRules:
    return AxisRules.of(params={"embed": "fsdp"}, activations={"batch": ("data", "fsdp")})


@register_strategy("tp", "Megatron tensor parallelism over `tensor`: attention heads and MLP column/row split, "
                   "vocab split", claims=("tensor",))
def _tp() -> AxisRules:
    split = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    return AxisRules.of(params=split, activations=split)


@register_strategy("sp", "Megatron sequence parallelism: residual-stream activations sharded on the sequence "
                   "over `tensor` (reduce-scatter / all-gather instead of all-reduce)", requires=("tp",))
def _sp() -> AxisRules:
    return AxisRules.of(activations={"residual_seq": "tensor"})


# ---- pipeline parallelism ------------------------------------------------------------------

register_step_option("pipeline", "the step runs the model's layer stack through a pipeline schedule over `stage` "
                     "(the recipe's schedule, repeats and micro_batches; meshtrain.parallel.pipeline)")


@register_strategy("pp", "pipeline parallelism: the layer stack split over `stage` (the `layers` dimension of "
                   "weights and optimizer state), micro-batches passed between neighbouring stages",
                   claims=("stage",), options={"pipeline": True})
def _pp() -> AxisRules:
    return AxisRules.of(params={"layers": "stage"})


# ---- expert parallelism --------------------------------------------------------------------

@register_strategy("ep", "expert parallelism: MoE expert weights split over `expert` on their `expert` dimension, "
                   "batch split over `expert` too; tokens reach their experts by all-to-all (meshtrain.parallel.moe)",
                   claims=("expert",))
def _ep() -> AxisRules:
    return AxisRules.of(params={"expert": "expert"}, activations={"batch": "expert"})


# ---- context parallelism -------------------------------------------------------------------

register_step_option("load_balance", "order of the sequence chunks over the context ring: 'zigzag' (device r holds "
                     "chunks r and 2R-1-r, equal causal work) or 'none' (meshtrain.parallel.context)")
register_step_option("flash_backend", "flash attention implementation: 'auto' (splash on TPU, cuDNN on GPU for "
                     "bf16/fp16 without packed documents, else blockwise XLA), 'xla', 'cudnn' or 'splash'")


@register_strategy("cp", "context parallelism: the sequence of activations and of the batch split over `context`; "
                   "attention by the recipe's kind (all_gather, ring, ulysses; zig-zag load balance)",
                   claims=("context",), options={"load_balance": "zigzag"})
def _cp() -> AxisRules:
    return AxisRules.of(activations={"seq": "context", "residual_seq": "context"})


@register_strategy("usp", "2-D context parallelism (USP): the sequence split over `context` × `ulysses`; attention "
                   "all-to-all over the inner `ulysses` axis, ring over `context`", claims=("ulysses",),
                   requires=("cp",))
def _usp() -> AxisRules:
    return AxisRules.of(activations={"seq": "ulysses", "residual_seq": "ulysses"})
