"""How generation stores the weights: as trained, bf16, or int8 weight-only; and where (device or host).

``int8``: each matrix is stored as int8 with one bf16 scale per output channel (symmetric,
round-to-nearest: ``scale = max|w| / 127`` over the dimensions the matmul contracts, so every output
channel of the stacked ``(layers, ...)`` weights has its own; f32 scales changed no greedy token of the
trained ``small`` model, and neither clipping the range (MSE-optimal) nor scales per 32 or 64 inputs
moved its greedy agreement with bf16 beyond one prompt). Inside the compiled step the engine turns one
layer at a time into compute form (``q * scale`` in bf16) inside the layer loop, so the dequantised
copy is one layer's, never the whole stack's. The embedding table gets one scale per row (a row is a
token's vector). The untied output projection ``lm_head_dv``, the norm scales and the MoE router stay
bf16: the head's rounding moves near-tied argmaxes (trained ``small``: one of 4 greedy continuations
parts at token 13 with an int8 head, none without). The scales replicate over the mesh axes that shard
a contracted dimension, so their share of a device's bytes grows with those axes (e.g. ``fsdp``).

``WeightMemory.HOST`` keeps the stacked layer weights (``blocks``, in whichever format) in host memory;
the engine copies each layer's shards to the device inside the layer loop (``jax.device_put`` to
``jax.memory.Space.Device``), so device memory holds one layer of the stack. XLA:CPU has a host memory
space (``pinned_host``, the compiled program's entry layout shows ``S(5)``) but it is the same RAM, so
on CPU this changes placement, not the process's memory; on GPU/TPU the copy is a host-to-device
transfer per layer per step.

Example::

    params = store_weights(params, WeightFormat.INT8)     # on the plan's shardings
    weight_bytes_per_device(params)                       # from the arrays' shardings
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.offload import HOST_MEMORY, to_host


class WeightFormat(str, enum.Enum):
    NONE = "none"    # as restored / trained (f32 unless the recipe keeps 16-bit parameters)
    BF16 = "bf16"
    INT8 = "int8"


class WeightMemory(str, enum.Enum):
    """Where the stacked layer weights (``blocks``) live between steps. ``host``: in page-locked host
    memory (:data:`meshtrain.offload.HOST_MEMORY`), each layer's shard copied to the device inside the
    layer loop when the layer runs (ZeRO-Inference); embedding, norms and head stay on the device."""

    DEVICE = "device"
    HOST = "host"


def weight_format(value) -> WeightFormat:
    try:
        return WeightFormat(value)
    except ValueError:
        raise ConfigError(f"--quantize {value!r}: use one of {[f.value for f in WeightFormat]}") from None


def weight_memory(value) -> WeightMemory:
    try:
        return WeightMemory(value)
    except ValueError:
        raise ConfigError(f"weight_memory {value!r}: use one of {[m.value for m in WeightMemory]} (the CLI's "
                          f"--offload-weights is host)") from None


#: the stacked layer weights: what ``WeightMemory.HOST`` keeps in host memory
LAYERS = "blocks"


#: the dimensions each built-in decoder weight contracts in its matmul (negative: a leading ``layers``
#: axis does not move them); the scale has one value per remaining (output) index
CONTRACTED: Dict[str, Tuple[int, ...]] = {
    "wq_dnh": (-3,), "wk_dkh": (-3,), "wv_dkh": (-3,), "wo_nhd": (-3, -2),
    "gate_df": (-2,), "up_df": (-2,), "down_fd": (-2,),
    "shared_gate_df": (-2,), "shared_up_df": (-2,), "shared_down_fd": (-2,),
    "gate_edf": (-2,), "up_edf": (-2,), "down_efd": (-2,),
    "embedding_vd": (-1,),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """``q`` (int8, the weight's shape and sharding) times ``scale`` (bf16, 1 on the contracted dims)."""

    q: jax.Array
    scale: jax.Array

    def dequantize(self, dtype=jnp.float32):
        return self.q.astype(dtype) * self.scale.astype(dtype)


def _quantize(w, axes):
    axes = tuple(a % w.ndim for a in axes)
    scale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes, keepdims=True) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(q, scale.astype(jnp.bfloat16))


def _scale_sharding(sh: NamedSharding, ndim: int, axes) -> NamedSharding:
    spec = list(sh.spec) + [None] * (ndim - len(sh.spec))
    for a in axes:
        spec[a % ndim] = None
    return NamedSharding(sh.mesh, PartitionSpec(*spec))


def _walk(params, fn, path=()):
    if isinstance(params, dict):
        return {k: _walk(v, fn, path + (k,)) for k, v in params.items()}
    return fn(path, params)


def store_weights(params, fmt: "WeightFormat | str"):
    """``params`` (nested dict of sharded arrays) in format ``fmt``; every array keeps its sharding."""
    fmt = weight_format(fmt)
    if fmt is WeightFormat.NONE:
        return params

    def convert(path, w):
        axes = CONTRACTED.get(path[-1])
        if fmt is WeightFormat.INT8 and axes is not None and w.ndim >= 2:
            return _quantize(w, axes)
        return w.astype(jnp.bfloat16) if jnp.issubdtype(w.dtype, jnp.floating) else w

    def placed(path, w):  # where each converted leaf lives: the weight's sharding (scales: see _scale_sharding)
        axes = CONTRACTED.get(path[-1])
        if fmt is WeightFormat.INT8 and axes is not None and w.ndim >= 2:
            return Int8Weight(w.sharding, _scale_sharding(w.sharding, w.ndim, axes))
        return w.sharding

    # one compiled conversion for the whole tree, each leaf written straight into its shards
    return jax.jit(lambda p: _walk(p, convert), out_shardings=_walk(params, placed))(params)


def dequantize(params, dtype=jnp.float32):
    """Inside a step: every :class:`Int8Weight` as a ``dtype`` array (others unchanged)."""
    return jax.tree.map(lambda x: x.dequantize(dtype) if isinstance(x, Int8Weight) else x, params,
                        is_leaf=lambda x: isinstance(x, Int8Weight))


def place_layers(params, memory: "WeightMemory | str"):
    """``params`` with the stacked layer weights in ``memory`` (their shardings unchanged otherwise)."""
    memory = weight_memory(memory)
    if memory is WeightMemory.DEVICE or LAYERS not in params:
        return params
    layers = params[LAYERS]
    return {**params, LAYERS: jax.device_put(layers, to_host(jax.tree.map(lambda x: x.sharding, layers)))}


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def weight_bytes_per_device(params) -> int:
    """Bytes of the weights one device holds in device memory, from each array's sharding (its shard
    shape × itemsize). Layer weights kept in host memory count one layer: the one being run."""
    total = 0
    for x in jax.tree.leaves(params):
        on_host = x.sharding.memory_kind == HOST_MEMORY
        total += _shard_bytes(x) // (x.shape[0] if on_host else 1)
    return total


def host_weight_bytes_per_device(params) -> int:
    """Bytes of the weights each device's host memory holds for it (``WeightMemory.HOST``: the layers)."""
    return sum(_shard_bytes(x) for x in jax.tree.leaves(params) if x.sharding.memory_kind == HOST_MEMORY)

