"""The planner's estimates against XLA on the `small` model, 8 simulated devices, every built-in recipe.

One module-scoped fixture compiles each recipe's train step once; the memory, collective and
step-time ranking checks all reuse it. Tables are printed (``pytest -s``) for the report.
"""

import jax
import optax
import pytest

import meshtrain as mt
from meshtrain.analysis import (MeasuredMemory, analytic_collectives, compare_rankings, compile_recipe,
                                estimate_memory, estimate_step_time, hlo_collectives, per_axis, per_axis_estimate,
                                time_round_robin)
from meshtrain.recipes import resolve_layer_loop

RECIPES = ("dp", "fsdp", "zero1", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp")
B, T = 16, 128
TOLERANCE = 0.10
#: the recipes whose compiled steps are run (test_step_time_ranking_runs_and_compares_orders): two of
#: different collectives (data; tensor + sequence), the fewest a ranking compares; the others are only compiled
#: and read. Cut: fsdp, a third step of the small model (~2.5 CPU s) that ranks by the same code.
TIMED = ("dp", "fsdp_tp_sp")


@pytest.fixture(scope="module")
def small():
    cfg = mt.models.get_config("small")
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    # The collective model describes the layer scan (deep models, and any with remat); the default loop
    # unrolls this 4-layer model (its memory: the `unrolled` fixture below).
    runs = {name: compile_recipe(abstract, mt.get_recipe(name).with_options(layer_loop="scan"), cfg, B, T,
                                 devices=jax.devices()[:8], init="host" if name in TIMED else False)
            for name in RECIPES}
    return cfg, runs


@pytest.mark.slow
def test_peak_memory_estimate_within_10_percent_of_xla(small):
    cfg, runs = small
    rows = []
    for name, run in runs.items():
        est = estimate_memory(run.plan, cfg).total
        measured = MeasuredMemory.of(run.compiled).peak
        rows.append((name, est, measured, est / measured - 1))
    print("\nrecipe       estimate MiB  measured MiB  error")
    for name, est, measured, err in rows:
        print(f"{name:12s} {est / 2**20:12.2f} {measured / 2**20:13.2f} {err:+7.1%}")
    bad = [(n, f"{e:+.1%}") for n, _, _, e in rows if abs(e) > TOLERANCE]
    assert not bad, f"memory estimate off by more than {TOLERANCE:.0%}: {bad}"


@pytest.fixture(scope="module")
def unrolled(small):
    """The default loop (``auto``: unrolled for this 4-layer model without remat) for a few recipes, and a
    partially unrolled scan (2 layers per iteration) with remat=full: XLA schedules across the layers."""
    cfg, _ = small
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    options = {"dp": {}, "fsdp": {}, "tp": {}, "fsdp_tp": {"layer_loop": "scan", "scan_unroll": 2, "remat": "full"}}
    return {name: compile_recipe(abstract, mt.get_recipe(name).with_options(**o), cfg, B, T,
                                 devices=jax.devices()[:8], init=False)
            for name, o in options.items()}


@pytest.mark.slow
def test_peak_memory_estimate_of_unrolled_layers_within_10_percent_of_xla(small, unrolled):
    cfg, _ = small
    rows = []
    for name, run in unrolled.items():
        r = run.plan.recipe
        loop = resolve_layer_loop(r.layer_loop, cfg.n_layers, r.remat, r.scan_unroll)
        est = estimate_memory(run.plan, cfg)
        measured = MeasuredMemory.of(run.compiled).peak
        rows.append((f"{name} {r.layer_loop.value}->{loop[0].value}:{loop[1]} remat={r.remat.value}", est.total,
                     measured, est.total / measured - 1))
        assert est.total == sum(b for _, b in est.components)
    print("\nrecipe, loop                          estimate MiB  measured MiB  error")
    for name, est, measured, err in rows:
        print(f"{name:38s} {est / 2**20:12.2f} {measured / 2**20:13.2f} {err:+7.1%}")
    assert rows[0][0].startswith("dp auto->unrolled:4")  # auto unrolls this shallow model
    bad = [(n, f"{e:+.1%}") for n, _, _, e in rows if abs(e) > TOLERANCE]
    assert not bad, f"memory estimate off by more than {TOLERANCE:.0%}: {bad}"


def test_estimate_components_add_up_and_parameters_match_the_compiled_arguments(small):
    cfg, runs = small
    for name, run in runs.items():
        est = estimate_memory(run.plan, cfg)
        assert est.total == sum(b for _, b in est.components)
        ma = run.compiled.memory_analysis()
        per = run.plan.per_device_bytes()
        # Arguments are exactly parameters + optimizer state + batch (+ the step counter).
        assert abs(ma.argument_size_in_bytes - (per["params"] + per["optimizer"] + per["batch"])) <= 64, name


@pytest.mark.parametrize("name", ["dp", "fsdp", "tp"])
def test_hlo_collective_bytes_agree_with_the_analytic_inventory(small, name):
    cfg, runs = small
    run = runs[name]
    hlo = per_axis(hlo_collectives(run.compiled.as_text(), run.plan.mesh))
    ana = per_axis_estimate(analytic_collectives(run.plan, cfg, "cpu"))
    print(f"\n{name}: HLO {hlo}\n{name}: analytic {ana}")
    assert set(ana) == set(hlo), (name, set(ana), set(hlo))
    for axes, kinds in hlo.items():
        assert ana[axes]["total"] == pytest.approx(kinds["total"], rel=TOLERANCE), (name, axes)
        for kind, nbytes in kinds.items():
            if nbytes > 0.05 * kinds["total"]:  # every kind that carries a real share of the bytes
                assert ana[axes].get(kind, 0) == pytest.approx(nbytes, rel=TOLERANCE), (name, axes, kind)


def test_collectives_of_the_other_recipes_agree_per_axis(small):
    cfg, runs = small
    for name in ("zero1", "hsdp", "fsdp_tp", "fsdp_tp_sp"):
        run = runs[name]
        hlo = per_axis(hlo_collectives(run.compiled.as_text(), run.plan.mesh))
        ana = per_axis_estimate(analytic_collectives(run.plan, cfg, "cpu"))
        total = sum(v["total"] for v in hlo.values())
        for axes, kinds in hlo.items():
            if kinds["total"] > 0.05 * total:
                assert ana.get(axes, {}).get("total", 0) == pytest.approx(kinds["total"], rel=TOLERANCE), (name, axes)


@pytest.mark.slow
def test_step_time_ranking_runs_and_compares_orders(small):
    """The ranking machinery on real compiled steps (figures only: timings are a benchmark, see
    tools/bench_planner.py and BENCHMARKS.md), and the comparison logic on fixed numbers."""
    cfg, runs = small
    estimates = {n: estimate_step_time(r.plan, cfg, "cpu").step_s for n, r in runs.items()}
    assert all(s > 0 for s in estimates.values())
    # the machinery runs real steps: two recipes rank as well as seven (each step of the small model is
    # seconds of CPU that show nothing more)
    timed = {n: runs[n] for n in TIMED}
    times = time_round_robin(list(timed.values()), rounds=1, warmup=0)
    assert set(times) == set(timed) and all(len(t) == 1 and t[0] > 0 for t in times.values())
    cmp = compare_rankings({n: estimates[n] for n in timed}, times, margin=0.25)
    print("\nestimated:", " < ".join(cmp.estimated_order), "\nmeasured: ", " < ".join(cmp.measured_order))
    assert sorted(cmp.estimated_order) == sorted(timed) and sorted(cmp.measured_order) == sorted(timed)
    # fixed numbers: a clear pair ordered the same way agrees, the other way disagrees, a near-tie is a tie
    measured = {"a": [1.0, 1.0], "b": [2.0, 2.1], "c": [2.05, 2.2]}
    same = compare_rankings({"a": 1.0, "b": 2.0, "c": 2.01}, measured, margin=0.25)
    assert same.agrees and ("a", "b") in same.distinguishable and ("b", "c") not in same.distinguishable
    flipped = compare_rankings({"a": 3.0, "b": 2.0, "c": 2.5}, measured, margin=0.25)
    assert not flipped.agrees and ("a", "b") in flipped.disagreements

