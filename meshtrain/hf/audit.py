"""The tensors of a HuggingFace folder against its config, before any weight is converted.

Every tensor the import reads must exist, have the shape ``config.json`` implies and a float dtype
(an int32 or bool "weight" is not a model's). Tensors it does not read are judged by what they are:

* layers or experts beyond ``config.json``'s counts (``model.layers.2.*`` with
  ``num_hidden_layers: 2``): the weights and the config disagree, and importing would drop part of
  the model: refused.
* ``lm_head.weight`` in a config that ties the head to the embedding: fine when its values equal the
  embedding (some exporters write both); a different head is refused (which one is the model?).
* anything else (e.g. the rotary caches some exporters write): reported as a warning, naming a few.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.hf.validate import FLOAT_DTYPES
from meshtrain.hf.weights import Mapping, SafetensorsFolder, hf_shape, mappings
from meshtrain.models import DecoderConfig

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: Rows of the embedding compared at a time with a tied config's lm_head (bounds the memory read).
COMPARE_ROWS = 4096


def _names(m: Mapping, shape: Sequence[int]) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(HF name, HF shape)`` of every tensor mapping ``m`` reads for a parameter of ``shape``."""
    lead = int(m.per_layer) + int(m.per_expert)
    expected = hf_shape(m.kind, tuple(shape[lead:]))
    layers = range(shape[0]) if m.per_layer else [0]
    experts = range(shape[1]) if m.per_expert else [0]
    return [(m.name.format(l=l, e=e), expected) for l in layers for e in experts]


def audit(files: SafetensorsFolder, cfg: DecoderConfig, shapes: Dict[str, Sequence[int]]) -> List[str]:
    """Check every tensor the import reads (``shapes``: meshtrain parameter path → shape); raise a
    :class:`ConfigError` for a missing, misshapen or non-float one, or for unread tensors that mean
    the config and the weights disagree. Returns the warning lines for the other unread tensors."""
    read = set()
    for m in mappings(cfg):
        for name, expected in _names(m, shapes[m.path]):
            dtype = files.stored_dtype(name, expected)  # raises when missing or misshapen
            if dtype not in FLOAT_DTYPES:
                raise ConfigError(f"{files.file_of(name)}: tensor {name!r} is stored as {dtype}; model weights are "
                                  f"floating point ({', '.join(FLOAT_DTYPES)}): these are not the model's weights")
            read.add(name)
    unread = sorted(set(files.where) - read)
    _refuse_extra_blocks(files, cfg, unread)
    notes = []
    if cfg.tie_embeddings and HEAD in unread:
        _check_tied_head(files, cfg)
        notes.append(f"{HEAD} equals {EMBEDDING} (config.json ties them)")
    if not unread:
        return []
    shown = ", ".join(repr(n) for n in unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
    return [f"{files.folder}: {len(unread)} tensor(s) are not part of the {cfg.name} model config.json describes "
            f"and are not imported: {shown}" + (f"; {notes[0]}" if notes else "")]


def _refuse_extra_blocks(files: SafetensorsFolder, cfg: DecoderConfig, unread: List[str]) -> None:
    for pattern, limit, field in ((r"model\.layers\.(\d+)\.", cfg.n_layers, "num_hidden_layers"),
                                  (r"\.experts\.(\d+)\.", cfg.n_experts, "num_local_experts")):
        extra = [n for n in unread if (hit := re.search(pattern, n)) and int(hit.group(1)) >= limit]
        if extra:
            count = len({re.search(pattern, n).group(1) for n in extra})
            raise ConfigError(f"{files.file_of(extra[0])} holds {len(extra)} tensor(s) of {count} more "
                              f"{'layer' if 'layers' in pattern else 'expert'}(s) than config.json's {field}="
                              f"{limit} (e.g. {extra[0]!r}): the weights and config.json disagree; use the config.json "
                              f"published with these weights (importing would drop part of the model)")


def _check_tied_head(files: SafetensorsFolder, cfg: DecoderConfig) -> None:
    shape = (cfg.vocab_size, cfg.d_model)
    try:
        head = files.slice(HEAD, shape)
    except ConfigError:
        raise ConfigError(f"{files.file_of(HEAD)}: {HEAD} does not have the embedding's shape {shape}, yet "
                          f"config.json ties them (tie_word_embeddings); set tie_word_embeddings to false or remove "
                          f"the tensor") from None
    embedding = files.slice(EMBEDDING, shape)
    for start in range(0, cfg.vocab_size, COMPARE_ROWS):
        rows = slice(start, min(start + COMPARE_ROWS, cfg.vocab_size))
        if not np.array_equal(np.asarray(head[rows]), np.asarray(embedding[rows])):
            raise ConfigError(f"{files.file_of(HEAD)}: {HEAD} differs from {EMBEDDING} (first at row >= {start}), "
                              f"yet config.json ties them (tie_word_embeddings); set tie_word_embeddings to false to "
                              f"import the separate head, or remove {HEAD}")
