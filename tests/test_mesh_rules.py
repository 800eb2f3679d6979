"""MeshSpec, AxisRules, strategies and recipes: construction and every error names what to change."""

import os

import jax
import pytest

import meshtrain as mt
from meshtrain.rules import AxisRules

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_meshspec_fills_minus_one_in_canonical_order():
    spec = mt.MeshSpec(ici={"tensor": 2, "fsdp": -1})
    assert spec.axis_names == ("fsdp", "tensor")
    mesh = spec.build()
    assert dict(mesh.shape) == {"fsdp": 4, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_meshspec_explicit_axis_types():
    mesh = mt.MeshSpec(ici={"data": -1}, axis_types="explicit").build()
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)


@pytest.mark.parametrize("ici, match", [
    ({"data": 2, "fsdp": 2}, "multiply to 4 but there are 8 devices"),
    ({"data": -1, "fsdp": -1}, "more than one -1"),
    ({"data": 3, "fsdp": -1}, "do not divide 8 devices"),
    ({"rows": 8}, "unknown mesh axis 'rows'"),
    ({"data": 0}, "size 0"),
])
def test_meshspec_errors(ici, match):
    with pytest.raises(mt.MeshError, match=match):
        mt.MeshSpec(ici=ici).build()


def test_meshspec_duplicate_axis_names_rejected():
    with pytest.raises(mt.MeshError, match="appears twice"):
        mt.MeshSpec(ici=[("data", 2), ("data", 4)])
    with pytest.raises(mt.MeshError, match="given twice"):
        mt.MeshSpec.parse("fsdp=2,fsdp=4")


def test_meshspec_dcn_groups_devices_dcn_major():
    # Two "slices" of 4 devices on one process: data spans the slices (outer), fsdp within.
    spec = mt.MeshSpec(ici={"fsdp": 4}, dcn={"data": 2})
    mesh = spec.build()
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    ids = [[d.id for d in row] for row in mesh.devices]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(mt.MeshError, match="does not divide"):
        mt.MeshSpec(ici={"fsdp": -1}, dcn={"data": 3}).build()


def test_abstract_mesh_for_more_devices_than_exist():
    mesh = mt.MeshSpec(ici={"fsdp": -1, "tensor": 8}).abstract(256)
    assert dict(mesh.shape) == {"fsdp": 32, "tensor": 8}


def test_resolve_maps_and_reports_rules():
    rules = mt.get_recipe("fsdp_tp").axis_rules()
    res = rules.resolve("params", ("embed", "mlp"), (64, 128), {"data": 1, "fsdp": 4, "tensor": 2}, path="w")
    assert tuple(res.spec) == ("fsdp", "tensor")
    assert res.rules == ("embed→fsdp [fsdp]", "mlp→tensor [tp]")


def test_resolve_errors_name_the_tensor():
    rules = mt.get_recipe("fsdp").axis_rules()
    sizes = {"fsdp": 8}
    with pytest.raises(mt.RulesError, match=r"parameter 'enc/w' \(shape \(64, 3\).*'colour'.*rules.params"):
        rules.resolve("params", ("embed", "colour"), (64, 3), sizes, path="enc/w")
    with pytest.raises(mt.RulesError, match=r"dimension 0 \('embed', size 60\) is not divisible by mesh axes "
                                            r"fsdp=8"):
        rules.resolve("params", ("embed", None), (60, 4), sizes, path="enc/w")
    res = rules.resolve("params", ("embed", None), (60, 4), sizes, path="enc/w", replicate_ok=frozenset({"embed"}))
    assert tuple(res.spec) == () and "replicated" in res.replicated_dims[0]
    with pytest.raises(mt.RulesError, match="rank 2 but 1 logical axes"):
        rules.resolve("params", ("embed",), (64, 4), sizes, path="enc/w")
    twice = AxisRules.defaults().merged(AxisRules.of(params={"embed": "fsdp", "mlp": "fsdp"}))
    with pytest.raises(mt.RulesError, match="mesh axis 'fsdp' is used by both 'embed' and 'mlp'"):
        twice.resolve("params", ("embed", "mlp"), (64, 64), sizes, path="mlp/w")


def test_strategy_conflicts_raise():
    with pytest.raises(mt.RecipeError, match="mesh axis 'data' is claimed by both 'dp' and 'zero1'"):
        mt.Recipe("bad", "", ("dp", "zero1"), mt.MeshSpec(ici={"data": -1}))
    with pytest.raises(mt.RecipeError, match=r"'sp' \(sequence parallelism\) needs 'tp'"):
        mt.Recipe("bad", "", ("fsdp", "sp"), mt.MeshSpec(ici={"fsdp": -1}))
    with pytest.raises(mt.RecipeError, match="used by none of its strategies"):
        mt.Recipe("bad", "", ("dp",), mt.MeshSpec(ici={"data": -1, "tensor": 2}))
    with pytest.raises(mt.RecipeError, match="unknown strategy 'pp2'"):
        mt.Recipe("bad", "", ("pp2",), mt.MeshSpec(ici={"data": -1}))
    with pytest.raises(mt.RecipeError, match="'usp' needs 'cp'"):
        mt.Recipe("bad", "", ("fsdp", "usp"), mt.MeshSpec(ici={"fsdp": -1}))


def test_batch_rule_composes_in_mesh_order():
    rules = mt.get_recipe("fsdp_tp").axis_rules()
    assert rules.table("activations")["batch"].mesh_axes == ("data", "fsdp")
    assert rules.table("activations")["residual_seq"].mesh_axes == ()
    sp = mt.get_recipe("fsdp_tp_sp").axis_rules()
    assert sp.table("activations")["residual_seq"].mesh_axes == ("tensor",)


@pytest.mark.parametrize("name", list(mt.BUILTIN_RECIPES))
def test_recipe_yaml_files_match_builtins(name):
    loaded = mt.get_recipe(os.path.join(ROOT, "recipes", f"{name}.yaml"))
    assert loaded.to_dict() == mt.get_recipe(name).to_dict()
    assert mt.Recipe.from_dict(mt.get_recipe(name).to_dict()) == mt.get_recipe(name)


def test_recipe_mesh_override_and_errors(tmp_path):
    r = mt.get_recipe("fsdp_tp").with_mesh(fsdp=2, tensor=4)
    assert r.mesh.resolve(8) == {"data": 1, "fsdp": 2, "tensor": 4}
    with pytest.raises(mt.MeshError, match="not part of this mesh"):
        mt.get_recipe("dp").with_mesh(tensor=2)
    with pytest.raises(mt.RecipeError, match="unknown recipe 'fsdp3'"):
        mt.get_recipe("fsdp3")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstrategies: [dp]\nmesh: {ici: {data: -1}}\nremat: sometimes\n")
    with pytest.raises(mt.RecipeError, match=r"remat='sometimes': use one of \['none', 'full'"):
        mt.get_recipe(str(bad))
    bad.write_text("name: x\nstrategies: [dp]\nmesh: {ici: {data: -1}}\nwarp: 9\n")
    with pytest.raises(mt.RecipeError, match="unknown recipe keys \\['warp'\\]"):
        mt.get_recipe(str(bad))
    with pytest.raises(mt.RecipeError, match="does not exist"):
        mt.get_recipe(str(tmp_path / "missing.yaml"))


def test_recipe_file_rules_override(tmp_path):
    f = tmp_path / "custom.yaml"
    f.write_text("name: custom\nstrategies: [fsdp]\nmesh: {ici: {fsdp: -1}}\n"
                 "rules: {params: {vocab: fsdp, embed: null}}\n")
    rules = mt.get_recipe(str(f)).axis_rules()
    assert rules.table("params")["vocab"].mesh_axes == ("fsdp",)
    assert rules.table("params")["embed"].mesh_axes == ()


def test_select_devices():
    from meshtrain.mesh import select_devices

    assert len(select_devices(None)) == 8 and [d.id for d in select_devices(3)] == [0, 1, 2]
    with pytest.raises(mt.MeshError, match="--devices 9 but only 8 cpu devices exist"):
        select_devices(9)
