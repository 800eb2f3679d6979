"""transformers' own Flax BERT (masked LM, dropout on) and ViT (dropout on), unedited, through the Trainer
with the rules files meshtrain ships (``recipes/rules/hf_bert.yaml``, ``hf_vit.yaml``): their big weights
are sharded, and each matches one device under the composed layout its rules decide (``RECIPES_OF`` in
tests/hf_models.py), relative loss difference <= 1e-5. Skipped without `transformers`."""

import re

import optax
import pytest

import meshtrain as mt

pytest.importorskip("transformers")

from hf_models import BERT_RULES, VIT_RULES, assert_matches_one_device, bert, vit  # noqa: E402  (needs transformers)


@pytest.mark.parametrize("name, build, rules", [("bert", bert, BERT_RULES), ("vit", vit, VIT_RULES)])
def test_encoder_attention_and_mlp_are_sharded_by_the_shipped_rules(name, build, rules):
    abstract = mt.abstract_state(build(rules), optax.adam(1e-3), annotations=rules)
    specs = {leaf.path: str(leaf.spec) for leaf in mt.make_plan(abstract, "fsdp_tp").group("params")}
    query = next(s for p, s in specs.items() if re.search(r"layer/0/attention/\w+/query/kernel$", p))
    mlp = next(s for p, s in specs.items() if p.endswith("layer/0/intermediate/dense/kernel"))
    assert "tensor" in query and "fsdp" in query and "tensor" in mlp, (name, query, mlp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit"])
def test_encoder_matches_one_device_under_its_recipes(name, tmp_path):
    assert_matches_one_device(name, tmp_path)
