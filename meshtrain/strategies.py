"""Strategies: one parallelism dimension each, as a typed, frozen object that owns its mesh axes, its
rules and its options; registered by kind, composed into recipes.

    DataParallel()  FSDP()  ZeRO(stage=1|2)  HSDP()  Tensor(sequence_parallel=False)
    Context(kind=ring, load_balance=zigzag, flash_backend=auto)  Expert(all_to_all=flat)
    Pipeline(schedule=gpipe, micro_batches=4, repeats=1)

Composition is strict: two strategies claiming one mesh axis is an error, a strategy whose requirements
are missing is an error, and rules for the same logical name from different strategies concatenate in
canonical mesh order (``dp``'s ``batch -> data`` plus ``fsdp``'s ``batch -> fsdp`` gives
``batch -> (data, fsdp)``). Kernels read a dimension's options from the step context
(``current_step_context().dimension(Context)``), never from a registry of loose names.

A new dimension is one file in ``parallel/`` (its kernel) plus one class here::

    @register_strategy
    @dataclasses.dataclass(frozen=True)
    class MySequence(Strategy):
        key: ClassVar[str] = "my_sp"
        description: ClassVar[str] = "sequence sharding of the residual stream"
        requires: ClassVar[Tuple[str, ...]] = ("tp",)
        chunk: int = setting(1, "chunks per device", minimum=1)

        def rules(self) -> AxisRules:
            return AxisRules.of(activations={"residual_seq": "tensor"})

A plain function still registers an option-less strategy:
``register_strategy("my_sp", "...", requires=("tp",))(lambda: AxisRules.of(...))``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, ClassVar, Dict, Iterable, Mapping, Optional, Tuple, Type

from meshtrain.axes import LOGICAL_AXES, MESH_AXES
from meshtrain.errors import RecipeError
from meshtrain.rules import TABLES, AxisRules, Rule
from meshtrain.settings import coerce_all, from_mapping, non_defaults, setting


class ContextKind(str, enum.Enum):
    """How a context-parallel dimension computes attention over the sharded sequence
    (:mod:`meshtrain.parallel.context`): ``all_gather`` (K/V all-gathered), ``ring`` (K/V blocks passed
    around ``context``), ``ulysses`` (all-to-all sequence ↔ heads), ``usp`` (Ulysses over ``ulysses`` ×
    ring over ``context``)."""

    ALL_GATHER = "all_gather"
    RING = "ring"
    ULYSSES = "ulysses"
    USP = "usp"


class IndivisibleHeads(str, enum.Enum):
    """What tensor parallelism does with query heads that do not divide the ``tensor`` axis (9 heads over
    ``tensor=2``; :mod:`meshtrain.parallel.heads`). The head weights are kept whole on every tensor rank
    either way (an array cannot be split unevenly), and key/value heads that do not divide are replicated
    (Megatron's and MaxText's layout: each rank computes the KV heads its query heads use).

    * ``pad``: the attention runs on heads rounded up to a multiple of ``tensor`` (zero heads, which add
      nothing and get no gradient), split over ``tensor``: each rank computes ``ceil(n / tensor)`` heads;
    * ``replicate``: every tensor rank computes all the heads (attention not split);
    * ``refuse``: a plan error, as for any other indivisible dimension.

    ``pad`` measured better (tools/bench_odd_heads.py, BENCHMARKS.md): 9 / 3 heads under ``tp`` on 8 devices,
    0.55× the FLOPs and 0.62× the temporaries per device of ``replicate`` for the same weight bytes, at the
    price of the attention's all-reduces (which any split of heads has)."""

    PAD = "pad"
    REPLICATE = "replicate"
    REFUSE = "refuse"


class LoadBalance(str, enum.Enum):
    """Order of the sequence chunks over the ring: ``zigzag`` (device ``r`` holds chunks ``r`` and
    ``2R-1-r``: equal causal work) or ``none`` (contiguous chunks)."""

    ZIGZAG = "zigzag"
    NONE = "none"


class FlashBackend(str, enum.Enum):
    """Which implementation ``flash`` attention uses; ``auto`` picks per platform and dtype (splash on
    TPU, cuDNN on GPU for bf16/fp16, packed documents on Hopper or newer, else blockwise XLA)."""

    AUTO = "auto"
    XLA = "xla"
    CUDNN = "cudnn"
    SPLASH = "splash"


class AllToAll(str, enum.Enum):
    """How expert parallelism exchanges tokens (:mod:`meshtrain.parallel.moe_exchange`).

    * ``flat``: one all-to-all over the whole ``expert`` axis (every device sends to every other);
    * ``hierarchical``: for an ``expert`` axis that spans slices/nodes (ICI × DCN), an all-to-all inside each
      slice first, then one across slices, so each device sends one message per remote slice instead of one
      per remote device (Tutel); with tensor parallelism each tensor rank moves only its ``1/tensor`` share of
      the hidden width and the ranks all-gather after (PCC), so DCN carries ``1/tensor`` of the bytes.
      Refused where the expert axis does not cross DCN.
    """

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"


class GradCompression(str, enum.Enum):
    """How the gradient reduction over the data-parallel axis that crosses DCN is sent
    (:mod:`meshtrain.parallel.grad_compression`): ``none`` (full precision), ``int8`` (per-block scales),
    ``onebit`` (sign bits + per-block scale, with error feedback kept as model state). The reduction inside a
    slice stays exact either way."""

    NONE = "none"
    INT8 = "int8"
    ONEBIT = "onebit"


class Schedule(str, enum.Enum):
    """Pipeline schedule over the ``stage`` axis (:mod:`meshtrain.parallel.pipeline`).

    * ``gpipe``: all micro-batches forward, then all backward; bubble (p-1)/(m+p-1);
    * ``circular``: each stage holds ``repeats`` non-adjacent layer groups; bubble (p-1)/(r·m+p-1);
    * ``1f1b``: after warm-up each stage alternates a forward and a backward (explicit per-stage VJP),
      so only the micro-batches in flight keep activations;
    * ``zero_bubble``: 1F1B with each backward split into its input-gradient part (on the critical path)
      and its weight-gradient part, deferred to fill the drain ticks (ZB-H1, lock-step SPMD variant).
    """

    GPIPE = "gpipe"
    CIRCULAR = "circular"
    ONE_F_ONE_B = "1f1b"
    ZERO_BUBBLE = "zero_bubble"

    @property
    def explicit_vjp(self) -> bool:
        """Whether the schedule writes its backward out per stage (1f1b, zero_bubble) instead of autodiff."""
        return self in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parallelism dimension. Subclasses set the class attributes ``key`` (the registered name),
    ``description``, ``claims`` (mesh axes owned) and ``requires`` (kinds that must be in the same recipe),
    declare their options as :func:`meshtrain.settings.setting` fields and return their rules from
    :meth:`rules`."""

    key: ClassVar[str] = ""
    description: ClassVar[str] = ""
    claims: ClassVar[Tuple[str, ...]] = ()
    requires: ClassVar[Tuple[str, ...]] = ()

    def __post_init__(self):
        coerce_all(self, self.key)

    @property
    def name(self) -> str:
        """The name the dimension goes by in rule sources, axis owners and errors."""
        return self.key

    def mesh_axes(self) -> Tuple[str, ...]:
        """The mesh axes this dimension owns (the class's ``claims`` unless an option adds some)."""
        return self.claims

    def rules(self) -> AxisRules:
        raise NotImplementedError

    def options(self) -> Dict[str, Any]:
        """The options that differ from their defaults, as plain values (YAML / JSON)."""
        return non_defaults(self)

    def to_plain(self) -> Any:
        """How a recipe file writes it: the bare name with default options, else ``{key: {options}}``."""
        alias = next((a for a, obj in _ALIASES.items() if obj == self), None)
        if alias is not None:
            return alias
        opts = self.options()
        return {self.key: opts} if opts else self.key

    def __str__(self) -> str:
        opts = self.options()
        return self.name + ("(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


_STRATEGIES: Dict[str, Type[Strategy]] = {}
#: Names that stand for one strategy with set options (``zero2`` = ``ZeRO(stage=2)``).
_ALIASES: Dict[str, Strategy] = {}


def register_strategy(name_or_cls=None, description: str = "", *, claims: Iterable[str] = (),
                      requires: Iterable[str] = ()):
    """Register a :class:`Strategy` subclass (``@register_strategy`` on the class), or, the short form,
    ``register_strategy(name, description, claims=..., requires=...)(fn)`` for a function
    ``fn() -> AxisRules`` (a dimension without options)."""
    if isinstance(name_or_cls, type) and issubclass(name_or_cls, Strategy):
        return _register(name_or_cls)
    name = name_or_cls

    def wrap(fn: Callable[[], AxisRules]):
        cls = dataclasses.dataclass(frozen=True)(type(f"Strategy_{name}", (Strategy,), {
            "__annotations__": {}, "key": name, "description": description, "claims": tuple(claims),
            "requires": tuple(requires), "rules": lambda self: fn()}))
        _register(cls)
        return fn

    return wrap


def _register(cls: Type[Strategy]) -> Type[Strategy]:
    if not isinstance(cls.key, str) or not cls.key.isidentifier():
        raise RecipeError(f"strategy class {cls.__name__}: key={cls.key!r}; use an identifier such as 'my_sp'")
    bad = [a for a in cls.claims if a not in MESH_AXES]
    if bad:
        raise RecipeError(f"strategy {cls.key!r} claims unknown mesh axes {bad}; use {MESH_AXES}")
    _STRATEGIES[cls.key] = cls
    return cls


def get_strategy(name: str) -> Strategy:
    """The strategy a bare name stands for (its kind with default options, or an alias like ``zero2``)."""
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return _STRATEGIES[name]()
    except KeyError:
        raise RecipeError(f"unknown strategy {name!r}; registered: {', '.join(known_names())}") from None


def known_names() -> Tuple[str, ...]:
    return tuple(sorted(set(_STRATEGIES) | set(_ALIASES) | set(_MODIFIERS)))


def strategies() -> Dict[str, Type[Strategy]]:
    """The registered strategy classes by kind."""
    return dict(_STRATEGIES)


def strategy_from_plain(item: Any, where: str) -> Strategy:
    """A strategy from a recipe file's entry: a name (default options) or ``{key: {option: value}}``."""
    if isinstance(item, Strategy):
        return item
    if isinstance(item, str):
        return get_strategy(item)
    if isinstance(item, Mapping) and len(item) == 1:
        (kind, opts), = item.items()
        if kind not in _STRATEGIES:
            raise RecipeError(f"{where}: unknown strategy {kind!r}; registered: {', '.join(sorted(_STRATEGIES))}")
        return from_mapping(_STRATEGIES[kind], opts, f"{where}.{kind}")
    raise RecipeError(f"{where}: a strategy is a name or a one-key mapping {{key: {{option: value}}}}, e.g. "
                      f"fsdp or {{cp: {{kind: ring}}}}; got {item!r}")


# Old names that used to be strategies of their own and are now an option of another dimension.
def _fold_sp(out, where):
    tensor = next((i for i, s in enumerate(out) if isinstance(s, Tensor)), None)
    if tensor is None:
        raise RecipeError(f"{where}: strategy 'sp' (sequence parallelism) needs 'tp' in the same recipe (it shards "
                          f"over its `tensor` axis); write {{tp: {{sequence_parallel: true}}}}")
    out[tensor] = dataclasses.replace(out[tensor], sequence_parallel=True)


def _fold_usp(out, where):
    context = next((i for i, s in enumerate(out) if isinstance(s, Context)), None)
    if context is None:
        raise RecipeError(f"{where}: strategy 'usp' needs 'cp' in the same recipe (it shards over its `context` "
                          f"axis); write {{cp: {{kind: usp}}}}")
    out[context] = dataclasses.replace(out[context], kind=ContextKind.USP)


_MODIFIERS: Dict[str, Callable] = {"sp": _fold_sp, "usp": _fold_usp}


def resolve_strategies(items: Iterable[Any], where: str = "strategies") -> Tuple[Strategy, ...]:
    """Strategy objects from names / mappings / objects. The old names ``sp`` and ``usp`` are read as
    before: they set ``Tensor.sequence_parallel`` and ``Context.kind=usp`` on the dimension they need."""
    if isinstance(items, tuple) and all(isinstance(item, Strategy) for item in items):
        return items   # already resolved: a recipe's copy keeps its dimensions (and their compose memo)
    out, later = [], []
    for i, item in enumerate(items):
        if isinstance(item, str) and item in _MODIFIERS:
            later.append(item)
        else:
            out.append(strategy_from_plain(item, f"{where}[{i}]"))
    for name in later:
        _MODIFIERS[name](out, where)
    return tuple(out)


class ResolvedStrategies(tuple):
    """Resolved strategy objects that keep :func:`compose`'s result for themselves (``compose_memo``,
    freed with them). ``ResolvedStrategies(x)`` of one is ``x`` itself, so a recipe's copies share it."""

    def __new__(cls, items=()):
        return items if type(items) is cls else super().__new__(cls, items)

    def __init__(self, items=()):
        if not hasattr(self, "compose_memo"):
            self.compose_memo: Dict[Tuple, Tuple[AxisRules, Dict[str, str]]] = {}


def compose(items: Iterable[Any]) -> Tuple[AxisRules, Dict[str, str]]:
    """Compose strategies into (rules on top of the defaults, mesh axis -> owning strategy name).

    :class:`ResolvedStrategies` (a recipe's) keep the result (the planner copies a recipe thousands of
    times, each copy validating through this), keyed by the classes' registration and the logical
    axes known."""
    dims = resolve_strategies(items)
    memo = dims.compose_memo if isinstance(dims, ResolvedStrategies) else None
    key = (tuple(_STRATEGIES.get(d.key) for d in dims), tuple(LOGICAL_AXES))
    hit = memo.get(key) if memo is not None else None
    if hit is None:
        hit = _compose(dims)
        if memo is not None:
            memo[key] = hit
    rules, owners = hit
    return rules, dict(owners)


def _compose(dims: Tuple[Strategy, ...]) -> Tuple[AxisRules, Dict[str, str]]:
    owners: Dict[str, str] = {}
    kinds = {d.key for d in dims} | {d.name for d in dims}
    for dim in dims:
        missing = [r for r in dim.requires if r not in kinds]
        if missing:
            raise RecipeError(f"strategy {dim.name!r} needs {missing} in the same recipe (it shards over their axes)")
        for axis in dim.mesh_axes():
            if axis in owners:
                raise RecipeError(
                    f"mesh axis {axis!r} is claimed by both {owners[axis]!r} and {dim.name!r}; a mesh axis serves "
                    f"one purpose, drop one of the strategies")
            owners[axis] = dim.name
    tables: Dict[str, Dict[str, Rule]] = {k: {} for k in TABLES}
    for dim in dims:
        rules = dim.rules()
        for kind in TABLES:
            for rule in getattr(rules, kind):
                source = rule.source if rule.source != "user" else dim.name  # a strategy may name its parts
                old = tables[kind].get(rule.logical)
                if old is None:
                    tables[kind][rule.logical] = Rule(rule.logical, rule.mesh_axes, source)
                    continue
                axes = sorted(set(old.mesh_axes) | set(rule.mesh_axes), key=MESH_AXES.index)
                tables[kind][rule.logical] = Rule(rule.logical, tuple(axes), f"{old.source}+{source}")
    composed = AxisRules(**{k: tuple(v.values()) for k, v in tables.items()})
    return AxisRules.defaults().merged(composed), owners


#: one help text for the option ``dp`` and ``hsdp`` share (one ``--grad-compression`` flag)
_COMPRESSION_HELP = ("gradient reduction across DCN over `data` (which must be the DCN axis): none, int8 "
                     "(per-block scales) or onebit (sign + scale, error feedback in the model state)")


_WARMUP_HELP = ("steps sent uncompressed before grad_compression starts (onebit with Adam, i.e. 1-bit Adam: "
                "required, 15-25 percent of the run, so that Adam's second moment is learnt from exact gradients "
                "before it freezes); 0: compressed from the first step")


def _feedback_rule(kind: GradCompression) -> Dict[str, str]:
    """``onebit`` keeps one error-feedback residual per ``data`` replica (logical ``grad_replica``)."""
    return {"grad_replica": "data"} if kind is GradCompression.ONEBIT else {}


# ---- built-in strategies -------------------------------------------------------------------

@register_strategy
@dataclasses.dataclass(frozen=True)
class DataParallel(Strategy):
    key: ClassVar[str] = "dp"
    description: ClassVar[str] = "data parallelism: batch split over `data`, weights replicated, gradients all-reduced"
    claims: ClassVar[Tuple[str, ...]] = ("data",)
    grad_compression: GradCompression = setting(GradCompression.NONE, _COMPRESSION_HELP, flag="grad_compression")
    grad_compression_warmup: int = setting(0, _WARMUP_HELP, minimum=0, flag="grad_compression_warmup")

    def rules(self) -> AxisRules:
        return AxisRules.of(params=_feedback_rule(self.grad_compression), activations={"batch": "data"})


@register_strategy
@dataclasses.dataclass(frozen=True)
class FSDP(Strategy):
    key: ClassVar[str] = "fsdp"
    description: ClassVar[str] = ("ZeRO-3: weights, gradients and optimizer state sharded over `fsdp` (on `embed`); "
                                  "batch split over `fsdp`; weights all-gathered per layer")
    claims: ClassVar[Tuple[str, ...]] = ("fsdp",)

    def rules(self) -> AxisRules:
        return AxisRules.of(params={"embed": "fsdp"}, activations={"batch": "fsdp"})


class ZeroStage(int, enum.Enum):
    """What ZeRO shards over `data`: ``1`` the optimizer state; ``2`` also the gradients."""

    ONE = 1
    TWO = 2


@register_strategy
@dataclasses.dataclass(frozen=True)
class ZeRO(Strategy):
    key: ClassVar[str] = "zero"
    description: ClassVar[str] = ("ZeRO-1/2: data parallelism with the optimizer state (stage 1) and the gradients "
                                  "(stage 2: reduce-scattered, updated weights all-gathered) sharded over `data`")
    claims: ClassVar[Tuple[str, ...]] = ("data",)
    stage: ZeroStage = setting(ZeroStage.ONE, "1: shard the optimizer state over `data`; 2: the gradients too",
                               flag="zero_stage")

    @property
    def name(self) -> str:
        return f"zero{self.stage.value}"

    @property
    def shard_gradients(self) -> bool:
        """The step keeps each gradient sharded like its parameter's optimizer state (ZeRO-2)."""
        return self.stage is ZeroStage.TWO

    def rules(self) -> AxisRules:
        return AxisRules.of(activations={"batch": "data"}, optimizer={"embed": "data"})


@register_strategy
@dataclasses.dataclass(frozen=True)
class HSDP(Strategy):
    key: ClassVar[str] = "hsdp"
    description: ClassVar[str] = "hybrid sharded DP: FSDP within `fsdp` groups, replicas across `data` (the DCN axis)"
    claims: ClassVar[Tuple[str, ...]] = ("data", "fsdp")
    grad_compression: GradCompression = setting(GradCompression.NONE, _COMPRESSION_HELP, flag="grad_compression")
    grad_compression_warmup: int = setting(0, _WARMUP_HELP, minimum=0, flag="grad_compression_warmup")

    def rules(self) -> AxisRules:
        return AxisRules.of(params={"embed": "fsdp", **_feedback_rule(self.grad_compression)},
                            activations={"batch": ("data", "fsdp")})


@register_strategy
@dataclasses.dataclass(frozen=True)
class Tensor(Strategy):
    key: ClassVar[str] = "tp"
    description: ClassVar[str] = ("Megatron tensor parallelism over `tensor`: attention heads and MLP column/row "
                                  "split, vocab split; optionally sequence parallelism on the residual stream")
    claims: ClassVar[Tuple[str, ...]] = ("tensor",)
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism: residual-stream activations sharded "
                                      "on the sequence over `tensor` (reduce-scatter / all-gather)")
    indivisible_heads: IndivisibleHeads = setting(IndivisibleHeads.PAD, "query heads that do not divide the tensor "
                                                  "axis: pad them to a multiple of it (zero heads), replicate them, "
                                                  "or refuse; KV heads that do not divide are replicated unless "
                                                  "refuse")

    def replicated_names(self) -> Tuple[str, ...]:
        """The logical names this dimension lets a plan keep whole when they do not divide ``tensor``."""
        return () if self.indivisible_heads is IndivisibleHeads.REFUSE else ("heads", "kv_heads")

    def rules(self) -> AxisRules:
        split = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
        acts = dict(split, **({"residual_seq": "tensor"} if self.sequence_parallel else {}))
        return AxisRules.of(params=split, activations=acts)


@register_strategy
@dataclasses.dataclass(frozen=True)
class Pipeline(Strategy):
    key: ClassVar[str] = "pp"
    description: ClassVar[str] = ("pipeline parallelism: the layer stack split over `stage` (the `layers` dimension "
                                  "of weights and optimizer state), micro-batches passed between neighbouring stages")
    claims: ClassVar[Tuple[str, ...]] = ("stage",)
    schedule: Schedule = setting(Schedule.GPIPE, "pipeline schedule", flag="schedule")
    micro_batches: int = setting(4, "micro-batches per step through the pipeline (>= stages)", minimum=1,
                                 flag="pipeline_micro_batches")
    repeats: int = setting(1, "layer groups per stage (circular schedule)", minimum=1, flag="repeats")

    def rules(self) -> AxisRules:
        return AxisRules.of(params={"layers": "stage"})


@register_strategy
@dataclasses.dataclass(frozen=True)
class Expert(Strategy):
    """Expert parallelism. Router settings (top-k, capacity factor, shared experts) are the model's
    (``MoEConfig``): they change the function trained, so they stay off the recipe."""

    key: ClassVar[str] = "ep"
    description: ClassVar[str] = ("expert parallelism: MoE expert weights split over `expert` on their `expert` "
                                  "dimension, batch split over `expert` too; tokens reach their experts by all-to-all "
                                  "(meshtrain.parallel.moe)")
    claims: ClassVar[Tuple[str, ...]] = ("expert",)
    all_to_all: AllToAll = setting(AllToAll.FLAT, "token exchange over `expert`: flat (one all-to-all) or "
                                   "hierarchical (inside each slice, then across slices; needs an expert axis "
                                   "that spans DCN)")

    def rules(self) -> AxisRules:
        return AxisRules.of(params={"expert": "expert"}, activations={"batch": "expert"})


@register_strategy
@dataclasses.dataclass(frozen=True)
class Context(Strategy):
    key: ClassVar[str] = "cp"
    description: ClassVar[str] = ("context parallelism: the sequence of activations and of the batch split over "
                                  "`context` (× `ulysses` for usp); attention by its kind")
    claims: ClassVar[Tuple[str, ...]] = ("context",)
    kind: ContextKind = setting(ContextKind.RING, "context-parallel attention kind", flag="context_kind")
    load_balance: LoadBalance = setting(LoadBalance.ZIGZAG, "order of the sequence chunks over the context ring")
    flash_backend: FlashBackend = setting(FlashBackend.AUTO, "flash attention implementation inside the context "
                                          "kernel and for a flash recipe")

    def mesh_axes(self) -> Tuple[str, ...]:
        return self.claims + (("ulysses",) if self.kind is ContextKind.USP else ())

    def rules(self) -> AxisRules:
        ring = AxisRules.of(activations={"seq": "context", "residual_seq": "context"}, source=self.key)
        if self.kind is not ContextKind.USP:
            return ring
        # the inner `ulysses` axis keeps its own rule source ("cp+usp" in plans, as before it was an option)
        inner = AxisRules.of(activations={"seq": "ulysses", "residual_seq": "ulysses"}, source="usp")
        return AxisRules(ring.params, ring.activations + inner.activations, ring.optimizer)


_ALIASES.update({"zero1": ZeRO(stage=ZeroStage.ONE), "zero2": ZeRO(stage=ZeroStage.TWO)})
