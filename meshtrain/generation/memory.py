"""Generation's memory per device from a plan, before anything runs (``meshtrain plan --generate``):
the weights in each :class:`~meshtrain.generation.weights.WeightFormat` and the KV cache.

Weights: each parameter's shard (its plan spec) × 4 bytes (f32), 2 (bf16), or 1 plus a bf16 scale per
output channel (int8: the scale's shard is the parameter's with the contracted dimensions at 1, so it
replicates over their mesh axes). Cache: ``2 × layers × batch × seq × kv_heads × head_dim`` split by
the activation rules (:mod:`meshtrain.generation.cache`) × the cache dtype. The batch counts the rows
generation pads to (a multiple of the data-parallel size). With the layer weights offloaded to host
memory (``--offload-weights``) the device holds the weights outside the layer stack and one layer's
shard of the stack (``weights_<format>_offloaded``); the host holds the whole stack's shards
(``host_weights_<format>``).
"""

from __future__ import annotations

from typing import Dict

import jax.numpy as jnp
import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.generation.cache import cache_bytes_per_device, shard_elements
from meshtrain.generation.weights import CONTRACTED, LAYERS, WeightFormat
from meshtrain.models.decoder import DecoderConfig
from meshtrain.strategies import Pipeline


def generation_bytes(cfg: DecoderConfig, plan, batch: int, seq: int) -> Dict[str, int]:
    """``{"weights_none", "weights_bf16", "weights_int8", "weights_<format>_offloaded",
    "host_weights_<format>", "kv_cache", "kv_cache_bf16", "batch", "seq"}`` per device (``kv_cache``: in
    the recipe's compute dtype, the cache of as-trained weights)."""
    if plan.recipe.dimension(Pipeline) is not None:
        raise ConfigError(f"--generate with recipe {plan.recipe.name!r}: generation runs without a pipeline (pp); "
                          f"plan it with a recipe without one (e.g. fsdp, tp, fsdp_tp)")
    sizes = plan.mesh_sizes
    out = {f"{kind}{f.value}{tail}": 0 for f in WeightFormat
           for kind, tail in (("weights_", ""), ("weights_", "_offloaded"), ("host_weights_", ""))}
    for leaf in plan.group("params"):
        stacked = leaf.path.split("/")[0] == LAYERS  # leading layers axis, never sharded when generating
        for fmt, nbytes in _leaf_bytes(leaf, sizes).items():
            out[f"weights_{fmt}"] += nbytes
            out[f"weights_{fmt}_offloaded"] += nbytes // leaf.shape[0] if stacked else nbytes
            out[f"host_weights_{fmt}"] += nbytes if stacked else 0
    rows = -(-batch // plan.data_parallel_size) * plan.data_parallel_size
    out["kv_cache"] = cache_bytes_per_device(cfg, plan, rows, seq, np.dtype(plan.recipe.compute_dtype))
    out["kv_cache_bf16"] = cache_bytes_per_device(cfg, plan, rows, seq, jnp.bfloat16)
    out["batch"], out["seq"] = rows, seq
    return out


def _leaf_bytes(leaf, sizes) -> Dict[str, int]:
    """One planned parameter's bytes per device in each :class:`WeightFormat`."""
    n = shard_elements(leaf.shape, leaf.spec, sizes)
    out = {WeightFormat.NONE.value: leaf.bytes_per_device, WeightFormat.BF16.value: 2 * n}
    axes = CONTRACTED.get(leaf.path.split("/")[-1])
    if axes is None or len(leaf.shape) < 2:
        out[WeightFormat.INT8.value] = 2 * n
        return out
    dims = {a % len(leaf.shape) for a in axes}
    scale_shape = tuple(1 if i in dims else d for i, d in enumerate(leaf.shape))
    scale_spec = tuple(None if i in dims else e for i, e in
                       enumerate(list(leaf.spec) + [None] * (len(leaf.shape) - len(leaf.spec))))
    out[WeightFormat.INT8.value] = n + 2 * shard_elements(scale_shape, scale_spec, sizes)
    return out
