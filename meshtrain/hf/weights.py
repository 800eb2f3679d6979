"""HuggingFace tensors (PyTorch naming, ``*.safetensors``) ↔ meshtrain's decoder parameters.

The layouts, once (HF ``Linear`` weights are ``(out, in)``; meshtrain keeps ``(in, out)`` with heads
split out, and one array per parameter for all layers, leading ``layers`` axis)::

    model.embed_tokens.weight                (V, D)      → embedding_vd            (V, D)
    model.layers.{l}.self_attn.q_proj.weight (N·H, D)    → blocks/attn/wq_dnh[l]   (D, N, H)
    ...k_proj / v_proj.weight                (K·H, D)    → blocks/attn/wk_dkh, wv_dkh[l] (D, K, H)
    ...o_proj.weight                         (D, N·H)    → blocks/attn/wo_nhd[l]   (N, H, D)
    ...mlp.gate_proj / up_proj.weight        (F, D)      → blocks/mlp/gate_df, up_df[l] (D, F)
    ...mlp.down_proj.weight                  (D, F)      → blocks/mlp/down_fd[l]   (F, D)
    ...input_layernorm / post_attention_layernorm.weight → blocks/attn_norm, mlp_norm/scale[l]
    model.norm.weight → final_norm/scale;  lm_head.weight (V, D) → lm_head_dv (D, V) (none when tied)
    Qwen2: ...self_attn.q_proj / k_proj / v_proj.bias (X·H,) → blocks/attn/bq_nh, bk_kh, bv_kh[l] (X, H)
    Gemma: the same names; its norm weights w are stored as they are (the model computes 1 + w)
    Mixtral: ...block_sparse_moe.gate.weight (E, D) → blocks/mlp/router_de[l] (D, E);
             ...experts.{e}.w1 / w3.weight (F, D) → gate_edf / up_edf[l, e] (D, F); w2 (D, F) → down_efd[l, e]

The rotary convention needs no change: HF's ``rotate_half`` pairs dimension ``i`` with ``i + H/2``,
as :func:`meshtrain.models.decoder.rope` does. Reading goes tensor slice by tensor slice
(``safetensors`` memory-maps the files): each device's block of each parameter is cut from the
HF tensors it covers and nothing else, so no process holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import ml_dtypes  # noqa: F401 - registers numpy's bfloat16, which safetensors' numpy reader returns
import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.models import DecoderConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: How a meshtrain block (one layer, one expert) is cut from an HF tensor, and written back.
#: ``T``: transposed matrix; ``HEADS_IN``: (X·H, D) rows → (D, X, H); ``HEADS_OUT``: (D, N·H) → (N, H, D);
#: ``HEADS_BIAS``: (X·H,) → (X, H).
SAME, T, HEADS_IN, HEADS_OUT, HEADS_BIAS = "same", "T", "heads_in", "heads_out", "heads_bias"


@dataclasses.dataclass(frozen=True)
class Mapping:
    """meshtrain parameter ``path`` ← HF tensor ``name`` (``{l}`` layer, ``{e}`` expert) by ``kind``."""

    path: str
    name: str
    kind: str
    per_layer: bool = True
    per_expert: bool = False


def mappings(cfg: DecoderConfig) -> List[Mapping]:
    layer = "model.layers.{l}."
    out = [Mapping("embedding_vd", "model.embed_tokens.weight", SAME, per_layer=False),
           Mapping("final_norm/scale", "model.norm.weight", SAME, per_layer=False)]
    if not cfg.tie_embeddings:
        out.append(Mapping("lm_head_dv", "lm_head.weight", T, per_layer=False))
    if cfg.qkv_bias:
        out += [Mapping("blocks/attn/bq_nh", layer + "self_attn.q_proj.bias", HEADS_BIAS),
                Mapping("blocks/attn/bk_kh", layer + "self_attn.k_proj.bias", HEADS_BIAS),
                Mapping("blocks/attn/bv_kh", layer + "self_attn.v_proj.bias", HEADS_BIAS)]
    out += [Mapping("blocks/attn/wq_dnh", layer + "self_attn.q_proj.weight", HEADS_IN),
           Mapping("blocks/attn/wk_dkh", layer + "self_attn.k_proj.weight", HEADS_IN),
           Mapping("blocks/attn/wv_dkh", layer + "self_attn.v_proj.weight", HEADS_IN),
           Mapping("blocks/attn/wo_nhd", layer + "self_attn.o_proj.weight", HEADS_OUT),
           Mapping("blocks/attn_norm/scale", layer + "input_layernorm.weight", SAME),
           Mapping("blocks/mlp_norm/scale", layer + "post_attention_layernorm.weight", SAME)]
    if cfg.n_experts:
        moe = layer + "block_sparse_moe."
        out += [Mapping("blocks/mlp/router_de", moe + "gate.weight", T),
                Mapping("blocks/mlp/gate_edf", moe + "experts.{e}.w1.weight", T, per_expert=True),
                Mapping("blocks/mlp/up_edf", moe + "experts.{e}.w3.weight", T, per_expert=True),
                Mapping("blocks/mlp/down_efd", moe + "experts.{e}.w2.weight", T, per_expert=True)]
    else:
        out += [Mapping("blocks/mlp/gate_df", layer + "mlp.gate_proj.weight", T),
                Mapping("blocks/mlp/up_df", layer + "mlp.up_proj.weight", T),
                Mapping("blocks/mlp/down_fd", layer + "mlp.down_proj.weight", T)]
    return out


def hf_shape(kind: str, block_shape: Sequence[int]) -> Tuple[int, ...]:
    """The HF tensor's shape for one meshtrain block of ``block_shape``."""
    if kind == SAME:
        return tuple(block_shape)
    if kind == T:
        return tuple(block_shape[::-1])
    if kind == HEADS_IN:
        d, x, h = block_shape
        return (x * h, d)
    if kind == HEADS_BIAS:
        return (block_shape[0] * block_shape[1],)
    d_ = block_shape[2]
    return (d_, block_shape[0] * block_shape[1])


def cut(kind: str, tensor, index: Tuple[slice, ...], block_shape: Sequence[int]) -> np.ndarray:
    """meshtrain's block ``index`` (slices of one layer/expert block of ``block_shape``) read from HF
    ``tensor`` (a safetensors slice: only the rows and columns needed are read)."""
    if kind == SAME:
        return np.asarray(tensor[index])
    if kind == T:
        return np.asarray(tensor[tuple(index[::-1])]).T
    if kind == HEADS_IN:  # (X·H, D) → (D, X, H)
        d_sl, x_sl, h_sl = index
        h = block_shape[2]
        x0, x1, _ = x_sl.indices(block_shape[1])
        rows = np.asarray(tensor[x0 * h:x1 * h, d_sl])
        return rows.reshape(x1 - x0, h, -1)[:, h_sl, :].transpose(2, 0, 1)
    if kind == HEADS_BIAS:  # (X·H,) → (X, H)
        x_sl, h_sl = index
        h = block_shape[1]
        x0, x1, _ = x_sl.indices(block_shape[0])
        return np.asarray(tensor[x0 * h:x1 * h]).reshape(x1 - x0, h)[:, h_sl]
    n_sl, h_sl, d_sl = index  # HEADS_OUT: (D, N·H) → (N, H, D)
    h = block_shape[1]
    n0, n1, _ = n_sl.indices(block_shape[0])
    cols = np.asarray(tensor[d_sl, n0 * h:n1 * h])
    return cols.reshape(-1, n1 - n0, h)[:, :, h_sl].transpose(1, 2, 0)


def to_hf(kind: str, block: np.ndarray) -> np.ndarray:
    """One whole meshtrain block as the HF tensor (export)."""
    if kind == SAME:
        return block
    if kind == T:
        return block.T
    if kind == HEADS_IN:
        d, x, h = block.shape
        return block.transpose(1, 2, 0).reshape(x * h, d)
    if kind == HEADS_BIAS:
        return block.reshape(-1)
    n, h, d = block.shape
    return block.transpose(2, 0, 1).reshape(d, n * h)


class SafetensorsFolder:
    """The tensors of a HuggingFace folder (``model.safetensors`` or an index of shards), opened
    lazily and memory-mapped; :meth:`slice` gives a sliceable view of one tensor."""

    def __init__(self, folder: str):
        self.folder = folder
        self._files: Dict[str, object] = {}
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, "rb") as f:
                    weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"cannot read {index!r} ({type(exc).__name__}: {exc}); it must be a JSON object "
                                  f"with a weight_map: use the index published with the weights") from None
            if not (isinstance(weight_map, dict) and weight_map and all(
                    isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v
                    for k, v in weight_map.items())):
                raise ConfigError(f"{index}: weight_map={str(weight_map)[:80]!r} is not valid: it must map each tensor "
                                  f"name to the file (in this folder) holding it; use the index published with the "
                                  f"weights")
            self.where: Dict[str, str] = dict(weight_map)
        elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            self.where = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
            if not self.where:
                raise ConfigError(f"{os.path.join(folder, SINGLE_FILE)} holds no tensors; download the model's "
                                  f"weights again")
        else:
            raise ConfigError(f"{folder!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}: pass a HuggingFace model "
                              f"folder with safetensors weights")

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open  # lazy: only imports and exports read safetensors

        path = os.path.join(self.folder, file)
        if not os.path.isfile(path):
            raise ConfigError(f"{path!r} is missing (named by {INDEX_FILE}); download every shard of the model")
        try:
            handle = safe_open(path, framework="np")
        except SafetensorError as exc:  # empty, truncated, or not safetensors at all
            raise ConfigError(f"{path} is not a readable safetensors file ({exc}); it is damaged or incomplete: "
                              f"download it again") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
        self._files[file] = handle
        return handle

    def slice(self, name: str, expected: Tuple[int, ...]):
        """A sliceable view of tensor ``name``, refused unless it has shape ``expected``."""
        return self._checked(name, expected)

    def stored_dtype(self, name: str, expected: Tuple[int, ...]) -> str:
        """The safetensors dtype (``F32``, ``BF16``, ``I32``...) of tensor ``name`` of shape ``expected``;
        reads the header only."""
        return self._checked(name, expected).get_dtype()

    def _checked(self, name: str, expected: Tuple[int, ...]):
        if name not in self.where:
            raise ConfigError(f"{self.folder}: tensor {name!r} is missing from the checkpoint (expected shape "
                              f"{expected}); is config.json the right one for these weights?")
        view = self._view(name)
        shape = tuple(view.get_shape())
        if shape != tuple(expected):
            raise ConfigError(f"{self.folder}: tensor {name!r} has shape {shape}; config.json implies {expected}")
        return view

    def _view(self, name: str):
        file = self.where[name]
        handle = self._files.get(file) or self._open(file)
        try:
            return handle.get_slice(name)
        except Exception as exc:  # SafetensorError: the index names a tensor its file does not hold
            raise ConfigError(f"{os.path.join(self.folder, file)} holds no tensor {name!r} ({INDEX_FILE} says it "
                              f"does: {exc}); download the model's files again") from None

    def dtype(self) -> str:
        """The dtype of the first tensor, as config.json's ``torch_dtype`` names it."""
        dtype = self._view(next(iter(self.where))).get_dtype()
        return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dtype, dtype.lower())

    def file_of(self, name: str) -> str:
        """The path of the file holding tensor ``name``."""
        return os.path.join(self.folder, self.where[name])


def block_reader(folder: SafetensorsFolder, m: Mapping, shape: Sequence[int]) -> Callable[[Tuple[slice, ...]], np.ndarray]:
    """``index → numpy block`` for the whole meshtrain parameter ``m.path`` of ``shape`` (leading
    ``layers`` and then ``expert`` axes where the mapping has them)."""
    lead = int(m.per_layer) + int(m.per_expert)
    block_shape = tuple(shape[lead:])

    def read(index: Tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not lead:
            return cut(m.kind, folder.slice(m.name, hf_shape(m.kind, block_shape)), index, block_shape)
        layers = range(*index[0].indices(shape[0]))
        out = []
        for l in layers:
            if not m.per_expert:
                name = m.name.format(l=l)
                out.append(cut(m.kind, folder.slice(name, hf_shape(m.kind, block_shape)), index[1:], block_shape))
                continue
            experts = range(*index[1].indices(shape[1]))
            out.append(np.stack([cut(m.kind, folder.slice(m.name.format(l=l, e=e), hf_shape(m.kind, block_shape)),
                                     index[2:], block_shape) for e in experts]))
        return np.stack(out)

    return read


def hf_tensors(cfg: DecoderConfig, params: Dict[str, np.ndarray]) -> Iterator[Tuple[str, np.ndarray]]:
    """``(HF name, tensor)`` for every parameter in ``params`` (``{path: whole host array}``)."""
    for m in mappings(cfg):
        value = params[m.path]
        if not m.per_layer:
            yield m.name, np.ascontiguousarray(to_hf(m.kind, value))
            continue
        for l in range(value.shape[0]):
            if not m.per_expert:
                yield m.name.format(l=l), np.ascontiguousarray(to_hf(m.kind, value[l]))
                continue
            for e in range(value.shape[1]):
                yield m.name.format(l=l, e=e), np.ascontiguousarray(to_hf(m.kind, value[l, e]))


def check_coverage(cfg: DecoderConfig, param_paths: Sequence[str], where: str) -> None:
    """Every parameter of the model has a mapping (a model with parts HF does not have is refused)."""
    mapped = {m.path for m in mappings(cfg)}
    missing = sorted(set(param_paths) - mapped)
    if missing:
        raise ConfigError(f"{where}: parameters {missing} have no HuggingFace counterpart in the "
                          f"{'mixtral' if cfg.n_experts else 'llama'} layout")
