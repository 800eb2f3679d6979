"""LoRA: low-rank adapters on chosen weights of any Flax NNX model, the rest of the model frozen.

A target weight ``W`` (shape ``in... × out...``) becomes ``W + (alpha / r) · A @ B`` with ``A``
``(in..., r)`` and ``B`` ``(r, out...)``: ``A`` starts uniform in ``±1/sqrt(in)`` and ``B`` at zero (as
PEFT does), so the adapted model starts equal to the base. Only ``A`` and ``B`` are ``nnx.Param``: the
step differentiates and the optimizer holds state for them alone. Every other weight of the model becomes
a :class:`~meshtrain.abstract.FrozenParam` (model state: planned and sharded by its logical names, never
updated), kept in the recipe's dtype, bf16, or int8 with one f32 scale per output channel (QLoRA-style).

Logical axes: ``A`` takes the base's input axes and ``lora_rank``; ``B`` takes ``lora_rank`` and the base's
output axes (``lora_rank`` is never sharded), so every recipe shards the adapters as it shards the base.

Example::

    lora = LoRAConfig(rank=8, alpha=16, targets=("q", "v"))
    factory = lora_factory(lambda rngs: Decoder(get_config("tiny"), rngs=rngs), lora)
    model = factory(nnx.Rngs(0))        # model.blocks.attn.wq_dnh is an Adapted module
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.abstract import FrozenParam
from meshtrain.annotate import constrain
from meshtrain.errors import ConfigError

#: Short target names → the built-in decoder's weights (``--lora-targets q,k,v,o``); anything else is a
#: regular expression searched in the parameter paths (``meshtrain plan --list-params`` prints them).
SHORT_TARGETS: Dict[str, str] = {
    "q": r"(^|/)wq_dnh$", "k": r"(^|/)wk_dkh$", "v": r"(^|/)wv_dkh$", "o": r"(^|/)wo_nhd$",
    "gate": r"(^|/)gate_df$", "up": r"(^|/)up_df$", "down": r"(^|/)down_fd$", "head": r"(^|/)lm_head_dv$",
}
#: Leading axes that batch a weight (stacked layers, experts): the adapters get their own copy per entry.
STACK_AXES = ("layers", "stage", "expert")


class LoRABase(str, enum.Enum):
    """How the frozen base weights are stored: ``param`` (the recipe's parameter dtype), ``bfloat16``,
    or ``int8`` (targets quantised per output channel, the other weights bf16: QLoRA-style)."""

    PARAM = "param"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` r (> 0), ``alpha`` (the update is scaled by ``alpha / rank``), ``targets`` (short names of
    :data:`SHORT_TARGETS` or path regexes) and ``base`` (:class:`LoRABase`).

    Example: ``LoRAConfig(rank=8, alpha=16, targets=("q", "k", "v", "o"))``."""

    rank: int
    alpha: float = 16.0
    targets: Tuple[str, ...] = ("q", "k", "v", "o")
    base: LoRABase = LoRABase.PARAM

    def __post_init__(self):
        object.__setattr__(self, "base", LoRABase(self.base))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"--lora-rank {self.rank!r}: give a positive integer, e.g. --lora-rank 8 (0: no LoRA)")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"--lora-alpha {self.alpha!r}: give a positive number, e.g. --lora-alpha 16")
        if not self.targets:
            raise ConfigError("--lora-targets is empty: name weights, e.g. --lora-targets q,k,v,o")
        for t in self.targets:
            try:
                re.compile(SHORT_TARGETS.get(t, t))
            except re.error as exc:
                raise ConfigError(f"--lora-targets {t!r} is not a valid regular expression ({exc}); give short "
                                  f"names ({','.join(SHORT_TARGETS)}) or a path pattern such as 'attn/w[qv]'") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def patterns(self) -> List[Tuple[str, "re.Pattern"]]:
        return [(t, re.compile(SHORT_TARGETS.get(t, t))) for t in self.targets]


def split_axes(names: Tuple[Optional[str], ...]) -> Tuple[int, int]:
    """``(stacked, inputs)``: how many leading dims batch the weight (:data:`STACK_AXES`) and how many of
    the rest are its input. The input is the first dim when it is ``embed`` (``wq_dnh``: embed → heads,
    head_dim), else all but the last (``wo_nhd``: heads, head_dim → embed; a Dense kernel ``(in, out)``)."""
    lead = 0
    while lead < len(names) and names[lead] in STACK_AXES:
        lead += 1
    rest = names[lead:]
    return lead, (1 if rest and rest[0] == "embed" else len(rest) - 1)


class Adapted(nnx.Module):
    """A frozen weight plus its adapters. ``w[...]`` is ``base + scale · A @ B`` (the model reads it as it
    read the plain parameter), in the adapters' (compute) dtype."""

    def __init__(self, base, names, cfg: LoRAConfig, rngs: nnx.Rngs):
        names = tuple(names) if names is not None else (None,) * base.ndim
        lead, n_in = split_axes(names)
        shape = tuple(base.shape)
        fan_in = math.prod(shape[lead:lead + n_in])
        bound = 1.0 / math.sqrt(fan_in)
        a_shape = shape[:lead + n_in] + (cfg.rank,)
        self.lora_a = nnx.Param(jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound),
                                out_sharding=names[:lead + n_in] + ("lora_rank",))
        self.lora_b = nnx.Param(jnp.zeros(shape[:lead] + (cfg.rank,) + shape[lead + n_in:], jnp.float32),
                                out_sharding=names[:lead] + ("lora_rank",) + names[lead + n_in:])
        self.n_in, self.scale, self.names = n_in, cfg.scale, names
        if cfg.base is LoRABase.INT8:
            q, s = quantize_int8(jnp.asarray(base, jnp.float32), lead, n_in)
            self.base = FrozenParam(q, out_sharding=names)
            self.base_scale = FrozenParam(s, out_sharding=names[:lead] + names[lead + n_in:])
        else:
            dtype = jnp.bfloat16 if cfg.base is LoRABase.BFLOAT16 else base.dtype
            self.base = FrozenParam(jnp.asarray(base, dtype), out_sharding=names)
            self.base_scale = None

    def _lead(self) -> int:  # stacked dims now (inside the layer loop one fewer than at build time)
        return self.lora_a[...].ndim - 1 - self.n_in

    def weight(self, dtype=None):
        """The base (dequantised) in ``dtype`` (default: the adapters')."""
        dtype = dtype or self.lora_a[...].dtype
        w = self.base[...]
        if self.base_scale is None:
            return w.astype(dtype)
        lead = self._lead()
        scale = jnp.expand_dims(self.base_scale[...], tuple(range(lead, lead + self.n_in)))
        return (w.astype(jnp.float32) * scale).astype(dtype)

    def delta(self):
        """``A @ B`` in the base's shape (not yet scaled)."""
        a, b = self.lora_a[...], self.lora_b[...]
        lead, r = self._lead(), a.shape[-1]
        a2 = a.reshape(a.shape[:lead] + (-1, r))
        b2 = b.reshape(b.shape[:lead] + (r, -1))
        return jnp.matmul(a2, b2).reshape(a.shape[:-1] + b.shape[lead + 1:])

    def __getitem__(self, index):
        w = self.weight() + jnp.asarray(self.scale, self.lora_a[...].dtype) * self.delta()
        names = self.names[len(self.names) - w.ndim:]   # inside the layer loop the stacked axis is gone
        if all(n is not None for n in names):
            w = constrain(w, names)
        return w[index]


def quantize_int8(w, lead: int, n_in: int):
    """``(int8 weights, f32 scale per output channel)``: the scale is max |w| over the input dims / 127."""
    axes = tuple(range(lead, lead + n_in))
    scale = jnp.max(jnp.abs(w), axis=axes) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axes)), -127, 127).astype(jnp.int8)
    return q, scale.astype(jnp.float32)


def _params(model: nnx.Module):
    """``[(path, module, attribute name, variable)]`` for every ``nnx.Param`` attribute of every module."""
    out = []
    for path, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.Param) and not isinstance(value, FrozenParam):
                out.append(("/".join(map(str, path + (name,))), module, name, value))
    return out


def add_adapters(model: nnx.Module, cfg: LoRAConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Put adapters on ``model``'s target weights (in place) and freeze every other parameter; returns it.

    Raises ``ConfigError`` for a target that matches no weight (listing the paths there are) and for a rank
    larger than a target's input or output width."""
    found = _params(model)
    patterns = cfg.patterns()
    unmatched = [t for t, p in patterns if not any(p.search(path) for path, *_ in found)]
    if unmatched:
        listing = ", ".join(path for path, *_ in found[:30]) + (" ..." if len(found) > 30 else "")
        raise ConfigError(f"--lora-targets {','.join(unmatched)}: no parameter matches; give short names "
                          f"({','.join(SHORT_TARGETS)}, for the built-in decoders) or regexes of these paths: "
                          f"{listing}")
    for path, module, name, var in found:
        names = var.get_metadata().get("out_sharding")
        if any(p.search(path) for _, p in patterns):
            _check_rank(path, tuple(var.shape), names, cfg.rank)
            setattr(module, name, Adapted(var[...], names, cfg, rngs))
        else:
            dtype = var.dtype if cfg.base is LoRABase.PARAM or not jnp.issubdtype(var.dtype, jnp.floating) \
                else jnp.bfloat16
            setattr(module, name, FrozenParam(jnp.asarray(var[...], dtype), out_sharding=names))
    return model


def _check_rank(path: str, shape, names, rank: int) -> None:
    lead, n_in = split_axes(tuple(names) if names is not None else (None,) * len(shape))
    if len(shape) - lead < 2:
        raise ConfigError(f"--lora-targets: {path} (shape {shape}) is not a matrix; LoRA adapts weights with an "
                          f"input and an output dimension: leave it out of the targets")
    width = min(math.prod(shape[lead:lead + n_in]), math.prod(shape[lead + n_in:]))
    if rank > width:
        raise ConfigError(f"--lora-rank {rank} is larger than {path}'s smallest dimension {width} (shape {shape}); "
                          f"give --lora-rank {width} or less")


class LoRAFactory:
    """``rngs -> model with adapters``: the user's ``base`` factory, then :func:`add_adapters`.
    :meth:`build_on` puts the adapters on given base weights (``--init-from``)."""

    def __init__(self, base: Callable, config: LoRAConfig):
        self.base, self.config = base, config

    def __call__(self, rngs: nnx.Rngs) -> nnx.Module:
        return add_adapters(self.base(rngs), self.config, rngs)

    def build_on(self, rngs: nnx.Rngs, base_params) -> nnx.Module:
        """The base model with ``base_params`` (a pure dict like its ``nnx.Param`` state), then adapters."""
        model = self.base(rngs)
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, base_params)
        nnx.update(model, state)
        return add_adapters(model, self.config, rngs)

    def __getattr__(self, name):  # the base factory's attributes (rules a factory carries)
        if name in ("base", "config"):
            raise AttributeError(name)
        return getattr(self.base, name)


def lora_factory(factory: Callable, config: Optional[LoRAConfig]) -> Callable:
    """``factory`` with adapters (``config``), or ``factory`` itself when ``config`` is ``None``."""
    return factory if config is None else LoRAFactory(factory, config)


def adapted_weights(model: nnx.Module) -> List[Tuple[str, Adapted]]:
    """``[(path of the weight, Adapted)]`` of a model with adapters (``blocks/attn/wq_dnh``, ...)."""
    return [("/".join(map(str, path)), m) for path, m in nnx.iter_modules(model) if isinstance(m, Adapted)]


# -- merging (host numpy): the export, and a LoRA checkpoint read as the plain model's parameters ---------
def adapter_pairs(params: Dict[str, "np.ndarray"]) -> Dict[str, tuple]:
    """``{weight path: (A, B)}`` of the adapters in flat ``params`` (``.../wq_dnh/lora_a`` → ``.../wq_dnh``)."""
    return {p[:-len("/lora_a")]: (params[p], params[p[:-len("/lora_a")] + "/lora_b"])
            for p in params if p.endswith("/lora_a")}


def delta_f64(a, b, ndim: int):
    """``A @ B`` in the shape of the weight (``ndim`` dims), in float64: the products of f32 values are exact
    and the sum over r is rounded once, at the end. ``A``: ``(stacked..., in..., r)``, ``B``:
    ``(stacked..., r, out...)``, so the stacked dims number ``a.ndim + b.ndim - 2 - ndim``."""
    lead, r = a.ndim + b.ndim - 2 - ndim, a.shape[-1]
    a2 = np.asarray(a, np.float64).reshape(a.shape[:lead] + (-1, r))
    b2 = np.asarray(b, np.float64).reshape(b.shape[:lead] + (r, -1))
    return np.matmul(a2, b2).reshape(a.shape[:-1] + b.shape[lead + 1:])


def merge_adapters(params, frozen, scale: float, dtype=np.float32) -> Dict[str, "np.ndarray"]:
    """The plain model's weights ``{path: array}`` from a LoRA state's flat host dicts: ``params`` (the
    adapters ``.../lora_a``, ``.../lora_b``) and ``frozen`` (``.../base`` [``.../base_scale``] and the other
    frozen weights at their own paths). Each target is ``base + scale · A @ B`` summed in float64 and rounded
    once to ``dtype`` (an int8 base dequantised first); the other weights are returned as they are.

    Example: ``merge_adapters(adapters, frozen, scale=16 / 8)["blocks/attn/wq_dnh"]``."""
    adapted = adapter_pairs(params)
    out = {}
    for path, value in frozen.items():
        weight = path.rsplit("/", 1)[0]
        if path.endswith("/base") and weight in adapted:
            base = np.asarray(value, np.float64)
            a, b = adapted[weight]
            base_scale = frozen.get(weight + "/base_scale")
            if base_scale is not None:  # int8: one scale per output channel, broadcast over the input dims
                n_in = base.ndim - np.ndim(base_scale)
                lead = a.ndim - 1 - n_in
                base = base * np.expand_dims(np.asarray(base_scale, np.float64), tuple(range(lead, lead + n_in)))
            out[weight] = (base + scale * delta_f64(a, b, base.ndim)).astype(dtype)
        elif not path.endswith("/base_scale") and weight not in adapted:
            out[path] = np.asarray(value)
    return out
