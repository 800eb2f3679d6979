"""Loss functions and the loss contract, below the train step so that analysis and the step share them.

The contract: ``loss_fn(model, batch)`` returns ``(loss_sum, weight)`` or ``(loss_sum, weight, metrics)``
(sums over the batch; the step divides by the global weight). :func:`unpack_loss` checks what a loss
returned; :func:`next_token_loss` is the decoders' loss, MoE router penalties included
(:func:`meshtrain.models.moe.moe_loss_terms`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Tuple, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.models.moe import moe_loss_terms, pop_moe_stats

#: ``loss_fn(model, batch) -> (loss_sum, weight)`` or ``(loss_sum, weight, {name: scalar sum})``.
LossFn = Callable[[nnx.Module, Any], Union[Tuple[jax.Array, jax.Array],
                                          Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]]]

#: Keys the step reports itself; a user metric may not reuse them.
RESERVED_METRICS = ("loss", "grad_norm", "weight", "tokens", "finite")


def next_token_loss(model: nnx.Module, batch: Dict[str, jax.Array]):
    """Cross-entropy of ``targets`` under ``model(inputs, positions, segment_ids)``; targets < 0 are
    ignored (padding). Returns ``(sum, count)`` in f32; for a model with MoE layers
    (:mod:`meshtrain.models.moe`) ``(sum + router penalty · count, count, {"moe_aux_loss", "moe_z_loss",
    "moe_load_max", "moe_drop_frac"} sums)``: the loss includes ``aux_coef·aux + z_coef·z``."""
    logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids")).astype(jnp.float32)
    targets = batch["targets"]
    mask = (targets >= 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    total, count = jnp.sum(ce * mask), jnp.sum(mask)
    stats = pop_moe_stats(model)
    if stats is None:
        return total, count
    extra, metrics = moe_loss_terms(stats, count)
    return total + extra, count, metrics


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} (" + ", ".join(_describe(e) for e in x) + ")"
    if isinstance(x, Mapping):
        return f"a dict with keys {list(x)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array {x.dtype}{list(x.shape)}"
    return f"a {type(x).__name__}"


def _is_scalar(x) -> bool:
    if isinstance(x, (bool, int, float)):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype") and tuple(x.shape) == () \
        and (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_))


def unpack_loss(out, loss_fn=None) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """``(loss_sum, weight, metrics)`` in f32 from what a loss function returned; ``ConfigError``
    naming what came back when it is not ``(loss_sum, weight[, metrics])`` of scalars."""
    name = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
    expected = ("expected (loss_sum, weight) or (loss_sum, weight, metrics): loss_sum and weight scalar sums "
                "over the batch (e.g. jnp.sum(per_example_loss * mask), jnp.sum(mask)) and metrics a dict of "
                "scalar sums that the step divides by the global weight")
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ConfigError(f"loss_fn {name} returned {_describe(out)}; {expected}")
    for what, value in (("loss_sum", out[0]), ("weight", out[1])):
        if not _is_scalar(value):
            raise ConfigError(f"loss_fn {name} returned {what} = {_describe(value)} (in {_describe(out)}); {expected}")
    metrics = out[2] if len(out) == 3 else {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"loss_fn {name} returned metrics = {_describe(metrics)}; {expected}")
    for key, value in metrics.items():
        if not isinstance(key, str) or key in RESERVED_METRICS:
            raise ConfigError(f"loss_fn {name} returned a metric named {key!r}; metric names are strings other than "
                              f"{RESERVED_METRICS} (the step reports those itself)")
        if not _is_scalar(value):
            raise ConfigError(f"loss_fn {name} returned metric {key!r} = {_describe(value)}; each metric must be a "
                              f"scalar sum over the batch (the step divides it by the global weight)")
    f32 = lambda v: jnp.asarray(v).astype(jnp.float32)  # noqa: E731
    return f32(out[0]), f32(out[1]), {k: f32(v) for k, v in metrics.items()}
