"""Saved activations of a decoder train step, per device, for any size and mesh, without compiling.

What the backward pass keeps is whatever JAX's autodiff saves under the recipe's remat policy. We
find it once per (remat, compute dtype) by tracing the loss's VJP abstractly on a *probe* decoder
whose sizes are distinct primes (``eval_shape``: no arrays, well under a second). Every saved
tensor's shape then factors uniquely into the probe's sizes, e.g. ``(L, B, T, kv, g, 2·hh)``, which
gives a formula in the config's sizes that holds for every model of the family::

    model = saved_activations(Remat.NONE, "float32")
    model.bytes_per_device(cfg, batch_size=16, seq_len=128, split=ActivationSplit(batch=8))
    model.describe(cfg, 16, 128)            # one row per saved tensor kind

Per device a saved tensor is divided by the batch split when it has a batch dimension, by the
tensor-parallel size when it has a heads / kv-heads / MLP / vocab dimension, and (sequence
parallelism) by the tensor-parallel size when it is a residual-stream tensor ``(b, t, d)``.
Tensors without a batch dimension are weights: the parameters themselves (not counted again),
their casts to the compute dtype (sharded like the parameters), or small derived tensors such as
broadcast norm scales (counted whole).

Next: :func:`meshtrain.analysis.memory.estimate_memory` adds parameters, gradients, optimizer
state and temporaries.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.abstract import abstract_state
from meshtrain.analysis.trace_cache import cached_trace, forget_for_this_process
from meshtrain.annotate import StepContext, step_context, unrolled_as_scan
from meshtrain.errors import ConfigError
from meshtrain.losses import next_token_loss
from meshtrain.mesh import MeshSpec
from meshtrain.models.decoder import Decoder, DecoderConfig
from meshtrain.precision import cast_floats
from meshtrain.recipes import AttentionKind, Remat
from meshtrain.remat_policies import DEFAULT_OFFLOAD
from meshtrain.rules import AxisRules

#: Probe sizes: distinct primes, so every dimension of a saved tensor factors into them.
#: ``n_heads = kv·g`` and ``head_dim = 2·hh`` (rotary embeddings split the head in halves).
PROBE = {"L": 5, "B": 7, "T": 11, "d": 13, "kv": 17, "g": 19, "hh": 23, "f": 29, "V": 31}
_SHARDED_BY_TENSOR = ("kv", "g", "f", "V")


def config_sizes(cfg, batch_size: int, seq_len: int) -> Dict[str, int]:
    """The probe variables for a real ``DecoderConfig`` and batch ``(B, T)``."""
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise ConfigError(f"{cfg.name}: n_heads must be a multiple of n_kv_heads and head_dim even")
    return {"L": cfg.n_layers, "B": batch_size, "T": seq_len, "d": cfg.d_model, "kv": cfg.n_kv_heads,
            "g": cfg.n_heads // cfg.n_kv_heads, "hh": cfg.head_dim // 2, "f": cfg.d_ff, "V": cfg.vocab_size}


@dataclasses.dataclass(frozen=True)
class ActivationSplit:
    """How activations are divided per device: ``batch`` ways (data-parallel size, per micro-batch
    the batch is ``B / micro_batches``), ``tensor`` ways for heads / MLP / vocab dims, and
    ``sequence`` ways for residual-stream tensors (Megatron sequence parallelism: ``tensor``)."""

    batch: int = 1
    tensor: int = 1
    sequence: int = 1
    micro_batches: int = 1
    #: context parallelism: every tensor with a sequence dimension is split this many ways
    context: int = 1


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One saved tensor kind: ``count`` tensors of ``const · Π size[var]**exp`` elements of ``dtype``."""

    exponents: Tuple[Tuple[str, int], ...]
    const: int
    dtype: str
    count: int
    cast: bool = False  # a parameter's shape in another dtype: a compute-dtype copy of a weight
    #: the last (minor) dimension: its exponents and constant, for layouts that tile it (see ``lanes``)
    minor: Tuple[Tuple[str, int], ...] = ()
    minor_const: int = 1
    #: XLA:TPU stores the minor dimension of an activation in tiles of 128 lanes (a ``(…, T, 16)`` tensor takes
    #: the room of ``(…, T, 128)``); 1: no padding (XLA:CPU/GPU)
    lanes: int = 1

    @property
    def is_weight(self) -> bool:
        return "B" not in dict(self.exponents)

    def elements(self, sizes: Mapping[str, int]) -> int:
        n = self.const * math.prod(sizes[v] ** e for v, e in self.exponents)
        if self.lanes > 1 and not self.is_weight:
            m = self.minor_const * math.prod(sizes[v] ** e for v, e in self.minor)
            if m > 1:  # a trailing 1 (keepdims) is laid out away
                n = n // m * (-(-m // self.lanes) * self.lanes)
        return n

    def divisor(self, split: ActivationSplit) -> int:
        ex = dict(self.exponents)
        div = split.batch if "B" in ex else 1
        if any(v in ex for v in _SHARDED_BY_TENSOR):
            div *= split.tensor * (split.context if "T" in ex else 1)
        elif "T" in ex and "d" in ex:
            div *= max(split.sequence, split.context)  # residual stream: SP and/or CP
        elif "T" in ex:
            div *= split.context
        return div

    def formula(self) -> str:
        names = {"hh": "h/2", "g": "n/kv"}
        parts = [f"{names.get(v, v)}" + (f"^{e}" if e > 1 else "") for v, e in self.exponents]
        return "·".join(([str(self.const)] if self.const != 1 else []) + parts) or "1"


def _factor(value: int) -> Tuple[Tuple[Tuple[str, int], ...], int]:
    exps, rest = {}, value
    for var, p in PROBE.items():
        while rest % p == 0:
            exps[var] = exps.get(var, 0) + 1
            rest //= p
    return tuple(sorted(exps.items())), rest


#: results an :class:`ActivationModel` keeps (per distinct sizes, split and selection) before starting afresh
_MEMO_LIMIT = 1 << 16


def _divisor_flags(ex: Mapping[str, int]) -> Tuple[bool, int]:
    """What :meth:`SavedTensor.divisor` reads of a tensor's exponents: whether it has a batch dimension, and
    which other split divides it: 0 a tensor-parallel dim and the sequence (``tensor · context``), 4 a
    tensor-parallel dim alone (``tensor``), 1 the residual stream ``(t, d)`` (``max(sequence, context)``),
    2 another sequence tensor (``context``), 3 none."""
    if any(v in ex for v in _SHARDED_BY_TENSOR):
        kind = 0 if "T" in ex else 4
    elif "T" in ex and "d" in ex:
        kind = 1
    elif "T" in ex:
        kind = 2
    else:
        kind = 3
    return "B" in ex, kind


def _divisor(flags: Tuple[bool, int], split: ActivationSplit) -> int:
    """:meth:`SavedTensor.divisor` from :func:`_divisor_flags` (the same products in the same order)."""
    has_batch, kind = flags
    div = split.batch if has_batch else 1
    if kind == 0:
        div *= split.tensor * split.context
    elif kind == 4:
        div *= split.tensor
    elif kind == 1:
        div *= max(split.sequence, split.context)
    elif kind == 2:
        div *= split.context
    return div


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """Saved tensors of one train step as formulas (from :func:`saved_activations`)."""

    remat: Remat
    compute_dtype: str
    tensors: Tuple[SavedTensor, ...]
    #: weight matrices per layer with an MLP-width dimension (gate, up, down: 3; a plain MLP: 2)
    mlp_matrices: int = 0
    #: normalisations (scale vectors): per layer, and outside the layers (the final norm)
    layer_norms: int = 0
    outer_norms: int = 0
    #: saved tensors the remat policy keeps in host memory (``Remat.OFFLOAD``): not in :attr:`tensors`,
    #: so every device figure leaves them out; :meth:`host_bytes_per_device` counts them
    host_tensors: Tuple[SavedTensor, ...] = ()

    # -- per-tensor figures and results, computed once per model (it is immutable) ----------------
    @functools.cached_property
    def _rows(self) -> Tuple[tuple, ...]:
        """Per saved tensor, what the byte counts read: ``(tensor, itemsize, is_weight, stacked, dims,
        T exponent, divisor flags)``."""
        out = []
        for t in self.tensors:
            ex = dict(t.exponents)
            out.append((t, np.dtype(t.dtype).itemsize, "B" not in ex, "L" in ex, frozenset(ex) - {"L"},
                        ex.get("T", 0), _divisor_flags(ex)))
        return tuple(out)

    def _memo(self, key, fn):
        memo = self.__dict__.get("_results_")
        if memo is None or len(memo) > _MEMO_LIMIT:
            memo = self.__dict__["_results_"] = {}
        try:
            return memo[key]
        except KeyError:
            out = memo[key] = fn()
            return out

    def bytes_per_device(self, cfg, batch_size: int, seq_len: int, split: ActivationSplit = ActivationSplit(),
                         *, weight_fraction: float = 0.0) -> int:
        """Bytes of saved activations on one device for one micro-batch.

        ``weight_fraction``: per-device share of a weight (``params per device / params total``),
        used for weight casts saved in the compute dtype; leave 0 when compute dtype = param dtype
        (then the saved weights are the parameters themselves).
        """
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)

        def compute():
            total = 0.0
            for t, itemsize, is_weight, _, _, _, flags in self._rows:
                nbytes = t.count * t.elements(sizes) * itemsize
                if is_weight:
                    total += nbytes * weight_fraction if t.cast else nbytes
                else:
                    total += nbytes / _divisor(flags, split)
            return int(total)

        return self._memo(("bytes", tuple(sizes.values()), split, weight_fraction), compute)

    def host_bytes_per_device(self, cfg, batch_size: int, seq_len: int,
                              split: ActivationSplit = ActivationSplit()) -> int:
        """Bytes of the saved tensors one device keeps in host memory for one micro-batch (``Remat.OFFLOAD``:
        each offloaded tensor divided like its device copy would be)."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)
        return int(sum(t.count * t.elements(sizes) * np.dtype(t.dtype).itemsize / t.divisor(split)
                       for t in self.host_tensors))

    def layer_bytes_per_device(self, cfg, batch_size: int, seq_len: int,
                               split: ActivationSplit = ActivationSplit()) -> int:
        """Bytes one layer saves on one device (the stacked ``L``-dimension tensors, divided by ``L``)."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)

        def compute():
            total = sum(t.count * t.elements(sizes) * itemsize / _divisor(flags, split)
                        for t, itemsize, is_weight, stacked, _, _, flags in self._rows if not is_weight and stacked)
            return int(total / cfg.n_layers)

        return self._memo(("layer", tuple(sizes.values()), split, cfg.n_layers), compute)

    def largest_layer_tensor_elements(self, cfg, batch_size: int, seq_len: int,
                                      split: ActivationSplit = ActivationSplit()) -> int:
        """Elements of one layer's largest saved tensor on one device for one micro-batch (the stacked
        ``L``-dimension tensors, divided by ``L``): the size of the largest cotangent its backward makes."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)

        def compute():
            return int(max((t.elements(sizes) / _divisor(flags, split) / cfg.n_layers
                            for t, _, is_weight, stacked, _, _, flags in self._rows if not is_weight and stacked),
                           default=0))

        return self._memo(("largest", tuple(sizes.values()), split, cfg.n_layers), compute)

    def tensor_bytes_per_device(self, cfg, batch_size: int, seq_len: int, split: ActivationSplit = ActivationSplit(),
                                *, dims: Tuple[str, ...] = ("B", "T", "V"), dtype: str = "float32",
                                stacked: "bool | None" = None, per_layer: bool = False) -> int:
        """Bytes of the saved ``dtype`` tensors over exactly ``dims`` (plus ``L`` for the stacked ones) on one
        device for one micro-batch, e.g. the f32 logits ``(B, T, V)`` or the residual stream ``(B, T, d)``.
        ``stacked``: only the per-layer (``True``) or only the unstacked (``False``) ones; ``per_layer``: the
        stacked ones divided by ``L``."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)
        want = frozenset(dims)

        def compute():
            name = str(np.dtype(dtype))
            total = 0.0
            for t, itemsize, is_weight, is_stacked, tdims, _, flags in self._rows:
                if is_weight or t.dtype != name or tdims != want or \
                        (stacked is not None and is_stacked != stacked) or (per_layer and not is_stacked):
                    continue
                total += t.count * t.elements(sizes) * itemsize / _divisor(flags, split)
            return int(total / cfg.n_layers) if per_layer else int(total)

        return self._memo(("tensor", tuple(sizes.values()), split, want, dtype, stacked, per_layer, cfg.n_layers),
                          compute)

    def tensor_count(self, *, dims: Tuple[str, ...], dtype: str, stacked: bool = True) -> int:
        """How many saved ``dtype`` tensors over exactly ``dims`` (plus ``L`` for the stacked ones) one layer
        (``stacked``) or the step outside the layers keeps, e.g. the MLP-width ``(B, T, f)`` ones."""
        want, name = frozenset(dims), str(np.dtype(dtype))
        return sum(t.count for t, _, is_weight, is_stacked, tdims, _, _ in self._rows
                   if not is_weight and t.dtype == name and tdims == want and is_stacked == stacked)

    def loop_constant_bytes_per_device(self, cfg, batch_size: int, seq_len: int,
                                       split: ActivationSplit = ActivationSplit()) -> int:
        """Bytes of the unstacked saved tensors over the sequence twice (``T²``: the dense attention mask or
        bias, built once outside the layer loop and saved for the loop's backward) on one device for one
        micro-batch. Unrolled, XLA fuses their computation into each consumer and keeps no buffer."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)

        def compute():
            return int(sum(t.count * t.elements(sizes) * itemsize / _divisor(flags, split)
                           for t, itemsize, is_weight, stacked, _, t_exp, flags in self._rows
                           if not is_weight and not stacked and t_exp >= 2))

        return self._memo(("loop_constant", tuple(sizes.values()), split), compute)

    def describe(self, cfg, batch_size: int, seq_len: int, split: ActivationSplit = ActivationSplit()) -> List[dict]:
        """Rows ``{formula, dtype, count, bytes_per_device}`` for the saved non-weight tensors, largest first."""
        sizes = config_sizes(cfg, batch_size // split.micro_batches, seq_len)
        rows = [{"formula": t.formula(), "dtype": t.dtype, "count": t.count,
                 "bytes_per_device": int(t.count * t.elements(sizes) * np.dtype(t.dtype).itemsize / t.divisor(split))}
                for t in self.tensors if not t.is_weight]
        return sorted(rows, key=lambda r: -r["bytes_per_device"])


@functools.lru_cache(maxsize=None)
def _probe_state(tie_embeddings: bool):
    """The probe decoder's abstract state (no arrays), shared by every (remat, dtype, attention) trace."""
    p = PROBE
    cfg = DecoderConfig("probe", p["V"], p["d"], p["L"], p["kv"] * p["g"], p["kv"], 2 * p["hh"], p["f"], p["T"],
                        tie_embeddings=tie_embeddings)
    return abstract_state(lambda rngs: Decoder(cfg, rngs=rngs))


def saved_activations(remat: "Remat | str" = Remat.NONE, compute_dtype: str = "float32",
                      tie_embeddings: bool = False, attention: "AttentionKind | str" = AttentionKind.DENSE,
                      lanes: int = 1, offloaded: Tuple[str, ...] = DEFAULT_OFFLOAD) -> ActivationModel:
    """Trace the probe decoder's loss VJP abstractly and turn its residuals into formulas.

    ``attention``: ``dense`` saves the ``T × T`` probabilities; every other kind is traced as
    ``flash`` (the context-parallel kinds save the same q, k, v, output and log-sum-exp per device,
    divided by the context split). ``lanes``: pad every activation's minor dimension to a multiple of it
    (128: XLA:TPU's tiled layouts; measured on v5p, e.g. ``f32[2,1024,16,8]`` takes 16 MiB, not 1).
    ``offloaded``: the names ``Remat.OFFLOAD`` keeps in host memory (traced: the residuals in host memory
    become :attr:`ActivationModel.host_tensors`)."""
    remat = Remat(remat)
    kind = AttentionKind.DENSE if AttentionKind(attention) is AttentionKind.DENSE else AttentionKind.FLASH
    # One key per distinct trace (a trace is ~0.4 CPU s, run by every `meshtrain train`'s pre-flight): the
    # names offloaded matter only to remat offload, and the arguments' spellings (a string or an enum,
    # given or defaulted) must not make a second trace of the same program.
    names = tuple(offloaded) if remat is Remat.OFFLOAD else DEFAULT_OFFLOAD
    base = _traced_activations(remat, str(jnp.dtype(compute_dtype)), bool(tie_embeddings), kind, names)
    if lanes == 1:
        return base
    pad = lambda ts: tuple(dataclasses.replace(t, lanes=lanes) for t in ts)  # noqa: E731
    return dataclasses.replace(base, tensors=pad(base.tensors), host_tensors=pad(base.host_tensors))


@functools.lru_cache(maxsize=None)
def _traced_activations(remat: Remat, compute_dtype: str, tie_embeddings: bool, kind: AttentionKind,
                        offloaded: Tuple[str, ...]) -> ActivationModel:
    """:func:`saved_activations` for one normalised key (``lanes`` 1): traced once per process, and once per
    version of the code on this machine (:mod:`meshtrain.analysis.trace_cache`: ``meshtrain train``'s
    pre-flight and ``meshtrain plan`` read the formulas an earlier process traced)."""
    key = [remat.value, compute_dtype, tie_embeddings, kind.value, list(offloaded)]
    return cached_trace("activations", key,
                        lambda: _trace_activations(remat, compute_dtype, tie_embeddings, kind, offloaded),
                        _model_to_json, _model_from_json)


def _model_to_json(model: ActivationModel) -> dict:
    out = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    out["remat"] = model.remat.value
    out["tensors"] = [dataclasses.asdict(t) for t in model.tensors]
    out["host_tensors"] = [dataclasses.asdict(t) for t in model.host_tensors]
    return out


def _tensor_from_json(d: dict) -> SavedTensor:
    pairs = lambda rows: tuple((str(v), int(e)) for v, e in rows)  # noqa: E731
    return SavedTensor(pairs(d["exponents"]), int(d["const"]), str(d["dtype"]), int(d["count"]), bool(d["cast"]),
                       pairs(d["minor"]), int(d["minor_const"]), int(d["lanes"]))


def _model_from_json(d: dict) -> ActivationModel:
    return ActivationModel(Remat(d["remat"]), str(d["compute_dtype"]),
                           tuple(_tensor_from_json(t) for t in d["tensors"]), int(d["mlp_matrices"]),
                           int(d["layer_norms"]), int(d["outer_norms"]),
                           tuple(_tensor_from_json(t) for t in d["host_tensors"]))


def _trace_activations(remat: Remat, compute_dtype: str, tie_embeddings: bool, kind: AttentionKind,
                       offloaded: Tuple[str, ...]) -> ActivationModel:
    """The trace itself (:func:`_traced_activations` keeps its results)."""
    from flax import nnx


    p = PROBE
    abstract = _probe_state(tie_embeddings)
    graphdef, params, rest = abstract.graphdef, abstract.params, abstract.model_state
    mesh = MeshSpec(ici={"data": 1}).abstract(1)
    ctx = StepContext(mesh, AxisRules.defaults(), frozenset(), remat, kind, offloaded=tuple(offloaded))
    dtype = jnp.dtype(compute_dtype)
    ids = jax.ShapeDtypeStruct((p["B"], p["T"]), jnp.int32)
    batch = {"inputs": ids, "targets": ids, "positions": ids, "segment_ids": ids}

    def residuals(params, batch):
        def loss(params):
            with step_context(ctx):
                m = nnx.merge(graphdef, cast_floats(params, dtype), rest)
                return next_token_loss(m, batch)[0]
        return jax.tree.leaves(jax.vjp(loss, params)[1])

    # a jaxpr's avals say which residuals live in host memory; the layers' residuals stacked (L, ...)
    with jax.sharding.use_abstract_mesh(mesh), unrolled_as_scan():
        saved = jax.make_jaxpr(residuals)(params, batch).out_avals
    param_shapes = {(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)}
    shapes_only = {s for s, _ in param_shapes}
    groups: Dict[Tuple, int] = {}
    for x in saved:
        if (tuple(x.shape), str(x.dtype)) in param_shapes:
            continue  # the parameters themselves: already counted as parameters
        cast = tuple(x.shape) in shapes_only
        exps: Dict[str, int] = {}
        const = 1
        for dim in x.shape:
            e, c = _factor(int(dim))
            const *= c
            for v, k in e:
                exps[v] = exps.get(v, 0) + k
        minor, minor_const = _factor(int(x.shape[-1])) if x.shape else ((), 1)
        host = getattr(x, "memory_space", None) == jax.memory.Space.Host
        key = (tuple(sorted(exps.items())), const, str(x.dtype), cast, minor, minor_const, host)
        groups[key] = groups.get(key, 0) + 1
    tensors = {h: tuple(SavedTensor(e, c, dt, n, cast, mi, mc)
                        for (e, c, dt, cast, mi, mc, host), n in sorted(groups.items(), key=str) if host is h)
               for h in (False, True)}
    leaves = jax.tree.leaves(params)
    mlp_matrices = sum(p["f"] in x.shape for x in leaves)
    layer_norms = sum(tuple(x.shape) == (p["L"], p["d"]) for x in leaves)
    outer_norms = sum(tuple(x.shape) == (p["d"],) for x in leaves)
    return ActivationModel(remat, str(dtype), tensors[False], mlp_matrices, layer_norms, outer_norms, tensors[True])


def _forget_traces() -> None:
    """Drop this process's traced formulas and stop reading or writing them on disk: what a test's monkeypatch
    of the traced code must do (the files' fingerprint would not see the patch)."""
    _traced_activations.cache_clear()
    forget_for_this_process()


saved_activations.cache_clear = _forget_traces
