"""The checks behind probe group ``inputs`` (issue 35), in process: a prepared token folder checked
field by field and file by file, a run header's model config read back into its class or refused
naming the field, stop ids inside the vocabulary, a sequence length the context layout divides."""

import dataclasses
import json
import os

import numpy as np
import pytest

from meshtrain.data.sources import load_source, prepared_meta
from meshtrain.errors import ConfigError
from meshtrain.generation.engine import check_stop_ids
from meshtrain.models import get_config
from meshtrain.models.configs import config_from_fields
from meshtrain.parallel.context import ContextLayout
from meshtrain.recipes import AttentionKind


def _folder(path, starts=None, **meta):
    os.makedirs(path)
    np.arange(100, dtype=np.uint16).tofile(os.path.join(path, "tokens.bin"))
    np.save(os.path.join(path, "doc_starts.npy"), np.array([0, 40, 70]) if starts is None else starts,
            allow_pickle=True)
    fields = {"format": "meshtrain-tokens/1", "tokenizer": "bpe:t", "vocab_size": 300, "dtype": "uint16",
              "num_tokens": 100, **meta}
    with open(os.path.join(path, "tokens.json"), "w") as f:
        json.dump({k: v for k, v in fields.items() if v is not None}, f)
    return str(path)


def test_a_sound_prepared_folder_loads(tmp_path):
    source = load_source(_folder(tmp_path / "ok"))
    assert list(source.doc_starts) == [0, 40, 70] and source.vocab_size == 300 and len(source) == 100


@pytest.mark.parametrize("damage, message", [
    ({"dtype": None}, "field 'dtype' is missing"),
    ({"vocab_size": None}, "field 'vocab_size' is missing"),
    ({"dtype": "float99"}, "field 'dtype' is 'float99'"),
    ({"num_tokens": "100"}, "field 'num_tokens' is '100'"),
    ({"vocab_size": True}, "field 'vocab_size' is True"),
    ({"starts": np.array([0, "a"], dtype=object)}, "doc_starts.npy' is not a .npy array of integers"),
    ({"starts": np.zeros((2, 2), np.int64)}, "not a 1-D integer array"),
    ({"starts": np.array([0.0, 4.5])}, "not a 1-D integer array"),
    ({"starts": np.array([5, 40])}, "the first document must start at 0"),
    ({"starts": np.array([0, 70, 40])}, "entry 2 is 40 after 70"),
    ({"starts": np.array([0, 40, 40])}, "not strictly increasing"),
    ({"starts": np.array([0, 100])}, "start 100 is past the end of the 100 tokens"),
])
def test_a_damaged_prepared_folder_names_the_file_and_field(tmp_path, damage, message):
    path = _folder(tmp_path / "bad", **damage)
    for read in (prepared_meta, load_source):  # the Trainer asks prepared_meta first, before any run folder
        with pytest.raises(ConfigError, match=message):
            read(path)


def test_a_missing_doc_starts_is_named(tmp_path):
    path = _folder(tmp_path / "bad")
    os.remove(os.path.join(path, "doc_starts.npy"))
    with pytest.raises(ConfigError, match=r"doc_starts.npy' is missing"):
        prepared_meta(path)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "vit-tiny", "bert-tiny", "llama3.1-8b", "qwen3-30b-a3b"])
def test_a_saved_config_reads_back_as_its_class(name):
    cfg = get_config(name)
    assert config_from_fields(json.loads(json.dumps(dataclasses.asdict(cfg))), "h") == cfg


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": "256"}, r"h: model_config field 'vocab_size' is '256', expected an integer >= 1"),
    ({"n_layers": 0}, "field 'n_layers' is 0"),
    ({"tie_embeddings": 1}, "field 'tie_embeddings' is 1, expected bool"),
    ({"bogus": 1}, "has field 'bogus', which DecoderConfig does not"),
    ({"capacity_factor": float("inf")}, r"h: model_config: capacity_factor=inf: use a finite number"),
    ({"capacity_factor": "1.25"}, "field 'capacity_factor' is '1.25', expected float or null"),
])
def test_a_damaged_saved_config_names_the_field(change, message):
    fields = {**dataclasses.asdict(get_config("tiny-moe")), **change}
    with pytest.raises(ConfigError, match=message):
        config_from_fields(fields, "h")
    with pytest.raises(ConfigError, match="not a mapping"):
        config_from_fields([1, 2], "h")


def test_stop_ids_must_be_in_the_vocabulary():
    cfg = get_config("tiny")
    assert check_stop_ids(cfg, [0, np.int32(255)]) == [0, 255]
    for bad, message in ((-1, "stop id -1"), (256, r"stop id 256 .* \(ids 0..255\)"), (2.0, "not an integer")):
        with pytest.raises(ConfigError, match=message):
            check_stop_ids(cfg, [bad])


def test_a_sequence_the_context_axes_do_not_divide_names_the_nearest_lengths():
    zigzag = ContextLayout(AttentionKind.RING, ("context",), ("context",), 4, zigzag=True)
    zigzag.check_length(96)
    with pytest.raises(ConfigError, match=r"sequence length 100 .* over context=4 .* multiple of 8 \(e.g. 96 or 104\)"):
        zigzag.check_length(100, {"context": 4})
    with pytest.raises(ConfigError, match=r"multiple of 8 \(e.g. 8\)"):
        zigzag.check_length(5)
    ulysses = ContextLayout(AttentionKind.ULYSSES, ("context",), ulysses_axes=("context",), ulysses=4)
    with pytest.raises(ConfigError, match=r"context axes context=4 = 4: use --seq-len a multiple of 4 \(e.g. 8 or 1"):
        ulysses.check_length(10, {"context": 4})
