"""Complete exports (issue 31): import → export keeps every field transformers reads from config.json
and generation_config.json (the special ids, sampling defaults, fields meshtrain does not compute
with such as ``initializer_range``), and a tied head stays tied."""

import json
import os
import sys

import pytest
from safetensors.numpy import load_file

from meshtrain.cli import main
from meshtrain.hf.convert import export_config
from meshtrain.models import get_config

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from probe_groups.hf import tiny_hf  # noqa: E402  (a tiny Llama-shaped HF folder: numpy + safetensors)

#: what transformers itself records about a folder (its path, the version that wrote it): not the model's
WRITER_FIELDS = ("_name_or_path", "transformers_version")
GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "do_sample": True, "temperature": 0.6,
              "top_p": 0.9, "max_new_tokens": 64}


def _without(d, keys=WRITER_FIELDS):
    return {k: v for k, v in d.items() if k not in keys}


def test_exported_config_carries_the_source_fields_and_meshtrain_sets_the_model():
    cfg = get_config("tiny")
    out = export_config(cfg, "bfloat16", {"eos_token_id": 2},
                        {"initializer_range": 0.01, "hidden_size": 999, "torch_dtype": "float32", "pad_token_id": 7,
                         "transformers_version": "4.0"})
    assert out["initializer_range"] == 0.01 and out["hidden_size"] == cfg.d_model   # the model's own fields win
    assert out["torch_dtype"] == "bfloat16" and "transformers_version" not in out
    assert "pad_token_id" not in out and out["eos_token_id"] == 2   # an id the import did not keep is not declared


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_keeps_every_field_transformers_reads(tmp_path, tied):
    src, run, back = str(tmp_path / "src"), str(tmp_path / "run"), str(tmp_path / "back")
    tiny_hf(src, tied=tied, rope_theta=1e5, pad_token_id=0, eos_token_id=[2, 3], initializer_range=0.01,
            attention_dropout=0.1, use_cache=False, pretraining_tp=1)
    with open(os.path.join(src, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    assert main(["import", src, "--out", run, "--devices", "1"]) == 0
    assert main(["export", run, "--out", back, "--devices", "1"]) == 0

    before, after = transformers.AutoConfig.from_pretrained(src), transformers.AutoConfig.from_pretrained(back)
    assert _without(after.to_dict()) == _without(before.to_dict())
    assert (after.bos_token_id, after.eos_token_id, after.pad_token_id) == (1, [2, 3], 0)
    assert after.rope_theta == 1e5 and after.tie_word_embeddings is tied and after.initializer_range == 0.01
    generation = transformers.GenerationConfig.from_pretrained(back)
    assert _without(generation.to_dict()) == _without(transformers.GenerationConfig.from_pretrained(src).to_dict())
    assert (generation.eos_token_id, generation.temperature, generation.do_sample) == ([2, 3], 0.6, True)
    tensors = load_file(os.path.join(back, "model.safetensors"))
    assert ("lm_head.weight" in tensors) is not tied   # tied: the embedding is the head, as in the source
