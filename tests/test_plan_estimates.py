"""The plan's memory estimate as named terms, the one byte formatter, and who owns the planner's memo.

Plans here live on ``AbstractMesh``es (pod-sized planning): nothing is compiled.
"""

import gc
import types

import optax
import pytest

import meshtrain as mt
from meshtrain.analysis import Component, estimate_memory
from meshtrain.analysis.layout import _PER_LAYOUT, _PER_PLAN, cached, layout_of, plan_variant
from meshtrain.analysis.report import single_text
from meshtrain.plan import fmt_bytes

B, T = 16, 128


def _plan(model: str, recipe: str, devices: int, **options):
    cfg = mt.models.get_config(model)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    r = mt.get_recipe(recipe).with_options(**options)
    return cfg, mt.make_plan(abstract, r, r.mesh.abstract(devices), batch=mt.BatchSpec(B, T))


# (model, recipe, devices, recipe options, backend): every branch of the formulas
CASES = {
    "unrolled": ("small", "fsdp", 8, {}, None),
    "scan remat micro-batches": ("small", "fsdp_tp", 8, {"layer_loop": "scan", "remat": "full", "grad_accum": 2},
                                 None),
    "xla:tpu bf16": ("small", "fsdp", 8, {"layer_loop": "scan", "compute_dtype": "bfloat16"}, "tpu"),
    "pipeline 1f1b": ("small", "pp", 8, {"schedule": "1f1b", "pipeline_micro_batches": 4}, None),
    "pipeline circular": ("small", "pp", 8, {"schedule": "circular", "pipeline_micro_batches": 4, "repeats": 2}, None),
    "moe": ("small-moe", "fsdp_ep", 8, {"layer_loop": "scan"}, None),
    "ring attention": ("small", "fsdp_cp", 8, {"layer_loop": "scan"}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_component_is_the_sum_of_its_named_terms(case):
    model, recipe, devices, options, backend = CASES[case]
    cfg, plan = _plan(model, recipe, devices, **options)
    est = estimate_memory(plan, cfg, backend=backend)
    assert [c for c, _ in est.components] == [Component.PARAMS, Component.GRADIENTS, Component.OPTIMIZER,
                                              Component.ACTIVATIONS, Component.TEMPORARIES, Component.BATCH]
    for component, nbytes in est.components:
        terms = est.terms_of(component)
        assert int(sum(t.bytes for t in terms)) == nbytes, (component, terms)
        assert all(t.name and t.formula and t.bytes for t in terms), terms
        listed = est.to_dict()["components"][component.value]["terms"]
        assert [(t["name"], t["bytes"]) for t in listed] == [(t.name, int(t.bytes)) for t in terms]
    assert any(len(est.terms_of(c)) > 1 for c, _ in est.components), est.terms


def test_the_plan_report_prints_the_terms_under_their_component():
    cfg, plan = _plan("small", "fsdp_tp", 8, layer_loop="scan", remat="full")
    text = single_text(plan, cfg, types.SimpleNamespace(hardware="h100"), table=False)
    est = estimate_memory(plan, cfg)
    temps = est.terms_of(Component.TEMPORARIES)
    assert [t.name for t in temps] == ["one layer's working set", "layer's weight gradient as multiplied",
                                       "f32 logits gradient"]
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  temporaries "))
    assert [line.split("+ ", 1)[1].split(":")[0] for line in lines[at + 1:at + 4]] == [t.name for t in temps]
    assert lines[at + 4].startswith("  batch ")


@pytest.mark.parametrize("nbytes, spec, unit, text", [
    (0, ".2f", None, "0 B"),
    (1023, ".2f", None, "1023 B"),
    (1536, ".2f", None, "1.50 KiB"),
    (3 * 2 ** 29, ".2f", None, "1.50 GiB"),
    (3 * 2 ** 29, ".1f", None, "1.5 GiB"),
    (123_456_789, ".3g", None, "118 MiB"),
    (5000 * 2 ** 40, ".2f", None, "5000.00 TiB"),
    (-2048, ".2f", None, "-2.00 KiB"),
    (2 ** 26, ".3f", "GiB", "0.062 GiB"),
    (123_456, ",.1f", "KiB", "120.6 KiB"),
    (float("inf"), ".3g", None, "unlimited"),
])
def test_one_byte_formatter(nbytes, spec, unit, text):
    assert fmt_bytes(nbytes, spec, unit) == text


def test_the_planner_memo_lives_in_the_planner_not_in_the_core_objects():
    cfg, plan = _plan("small", "fsdp", 8)
    estimate_memory(plan, cfg)
    assert not hasattr(plan, "cached") and not hasattr(plan, "with_recipe")
    assert set(vars(plan)) <= {f for f in plan.__dataclass_fields__} | {"_sizes", "_groups", "_group_bytes"}
    assert "_tables" not in vars(plan.rules)
    # the abstract state keeps only its own flattened structures (cached properties, freed with it)
    assert {k for k in vars(plan.abstract) if k not in plan.abstract.__dataclass_fields__} <= {
        "param_structure", "optimizer_structure", "model_state_structure"}

    # a variant (other knobs, one layout) shares the layout-only figures and has its own per-plan ones
    variant = plan_variant(plan, plan.recipe.with_options(remat="full"))
    calls = []
    first = cached(plan, "probe", lambda p: calls.append(p) or object(), layout_only=True)
    assert cached(variant, "probe", lambda p: calls.append(p), layout_only=True) is first and len(calls) == 1
    assert layout_of(variant) is not layout_of(plan)  # per plan: the layout reads the recipe's knobs

    # dropped with the plan
    slots = (len(_PER_PLAN), len(_PER_LAYOUT))
    del plan, variant, first, calls
    gc.collect()
    assert (len(_PER_PLAN), len(_PER_LAYOUT)) < slots
