"""Pipeline parallelism (``pp`` recipes; meshtrain.parallel.pipeline): parity with one device for each
schedule alone and composed with FSDP × TP, 1F1B's memory against GPipe's, neighbour-only stage traffic
in the HLO, checkpoints across stage counts. Schedules, the bubble from compiled FLOPs, bad input and
the other models' pipeline parity: tests/test_pipeline_schedules.py."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from helpers import (assert_bit_exact, assert_on_mesh, host, kept_grads, put, rel_diff, tiny_abstract, token_batch,
                     with_kept_grads)

import meshtrain as mt
from meshtrain.checkpoint import Checkpointer

B, T, LAYERS, STEPS = 16, 16, 4, 10
SCHEDULES = ("gpipe", "circular", "1f1b")


def _abstract():
    # the optimizer keeps the gradients the step applied (helpers.with_kept_grads): gradients and losses come
    # from one compiled train step per recipe, not a train step and a separate make_grad_fn program
    return tiny_abstract(with_kept_grads(optax.adamw(3e-3)), n_layers=LAYERS, n_heads=4, n_kv_heads=2, head_dim=16)


_INIT = {}


def _initial(plan):
    """The seed-0 state laid out for ``plan`` (initialised once, then only resharded: no init compiles)."""
    if "host" not in _INIT:
        _INIT["host"] = host(mt.init_state(plan, seed=0))
    return jax.device_put(_INIT["host"], mt.state_shardings(plan))


def _run(recipe, n_devices=8, steps=STEPS, abstract=None):
    """(step-0 grads on host, losses of ``steps`` steps, the compiled program, plan). ``steps=0``: the
    compiled program is ``make_grad_fn``'s and gives the gradients alone; else it is the train step, whose
    first step's gradients the optimizer kept."""
    mesh = recipe.mesh.build(jax.devices()[:n_devices])
    plan = mt.make_plan(abstract or _abstract(), recipe, mesh, batch=mt.BatchSpec(B, T))
    state = _initial(plan)
    batch0 = put(token_batch(0, B, T), plan)
    if not steps:
        compiled = mt.make_grad_fn(plan).lower(state, batch0).compile()
        return jax.tree.map(np.asarray, compiled(state, batch0)[1]), np.array([]), compiled, plan
    compiled = mt.make_train_step(plan).lower(state, batch0).compile()
    losses = []
    for i in range(steps):
        state, metrics = compiled(state, batch0 if i == 0 else put(token_batch(i, B, T), plan))
        if i == 0:
            grads = kept_grads(state)
        losses.append(float(metrics["loss"]))
    return grads, np.array(losses), compiled, plan


@pytest.fixture(scope="module")
def baseline():
    return _run(mt.get_recipe("dp"), n_devices=1)


@pytest.fixture(scope="module")
def composed():
    """Each schedule on stage=2 × fsdp=2 × tensor=2 with m = 4p = 8 micro-batches (also feeds the
    memory and HLO checks)."""
    return {}


def _composed(composed, schedule):
    if schedule not in composed:
        recipe = mt.get_recipe("pp_fsdp_tp").with_options(schedule=schedule, pipeline_micro_batches=8,
                                                          repeats=2 if schedule == "circular" else 1)
        composed[schedule] = _run(recipe)
    return composed[schedule]


def _assert_parity(got, want, steps=STEPS):
    g_grads, g_losses = got[:2]
    w_grads, w_losses = want[:2]
    worst = jax.tree.map(rel_diff, g_grads, w_grads)
    assert max(jax.tree.leaves(worst)) <= 1e-5, worst
    if steps:
        assert rel_diff(g_losses[:steps], w_losses[:steps]) <= 1e-5, (g_losses, w_losses)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parity_composed_with_fsdp_and_tp(baseline, composed, schedule):
    got = _composed(composed, schedule)
    assert got[3].mesh_sizes == {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}
    _assert_parity(got, baseline)
    assert baseline[1][-1] < baseline[1][0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:pipeline bubble")  # m = p on purpose: the smallest valid pipeline
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])  # circular alone: its tables, FLOPs and composed run
def test_parity_alone_four_stages(baseline, schedule):
    # stage=4 × data=2, 4 layers: one layer per stage; gradients at step 0 and the HLO's stage traffic.
    recipe = mt.get_recipe("pp").with_mesh(stage=4, data=2).with_options(schedule=schedule, pipeline_micro_batches=4)
    got = _run(recipe, steps=0)
    _assert_parity(got, baseline, steps=0)
    _assert_neighbours_only(got[2].as_text(), got[3])


# ---- HLO -----------------------------------------------------------------------------------------

def _groups(line, n):
    """Replica groups of a collective line as lists of device ids (None when printed another way)."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(v) for v in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(v) for v in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if m and "device_ids=(" not in line:
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        axes = re.findall(r"'(\w+)'", m.group(2))
        sizes = [int(s) for _, s in names]
        ids = np.arange(n).reshape(sizes)
        keep = [i for i, (a, _) in enumerate(names) if a in axes]
        rest = [i for i in range(len(names)) if i not in keep]
        return ids.transpose(rest + keep).reshape(-1, int(np.prod([sizes[i] for i in keep]))).tolist()
    return None


def _assert_neighbours_only(text, plan):
    stage_of = {int(d.id): s for s in range(plan.mesh_sizes["stage"]) for d in
                np.asarray(plan.mesh.devices)[s].reshape(-1)}
    p = plan.mesh_sizes["stage"]
    loop = [ln for ln in text.splitlines() if "while/body" in ln]
    permutes = [ln for ln in loop if "collective-permute(" in ln or "collective-permute-start(" in ln]
    assert permutes, "the schedule should pass micro-batches with collective-permutes"
    crossing = 0
    for ln in permutes:  # pairs within one stage are fsdp/tensor re-layouts; across stages only s -> s±1 (ring)
        for a, b in re.findall(r"\{(\d+),(\d+)\}", ln.split("source_target_pairs=")[1].split("}}")[0] + "}"):
            ds = (stage_of[int(b)] - stage_of[int(a)]) % p
            assert ds in (0, 1, p - 1), f"collective-permute between stages {stage_of[int(a)]} and {stage_of[int(b)]}"
            crossing += ds != 0
    assert crossing, "no collective-permute crosses `stage`"
    for ln in loop:  # inside the stages' layers (vmapped over `stage`) weights are gathered over fsdp only
        if ("all-gather(" in ln or "all-gather-start(" in ln) and "vmap()" in ln:
            groups = _groups(ln, len(stage_of))
            assert groups is not None, ln[:200]
            for g in groups:
                assert len({stage_of[d] for d in g}) == 1, f"all-gather across `stage`: {ln[:200]}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hlo_stage_traffic_between_neighbours_only(composed, schedule):
    _, _, compiled, plan = _composed(composed, schedule)
    _assert_neighbours_only(compiled.as_text(), plan)


# ---- memory and bubble ---------------------------------------------------------------------------

def test_1f1b_temp_memory_at_most_half_of_gpipe(composed):
    # the whole train steps' temporaries (the optimizer update's included, the same in both): the schedule's
    # activation memory has to halve the step's total, a harder bound than the gradient program's alone
    gpipe = _composed(composed, "gpipe")[2].memory_analysis().temp_size_in_bytes
    ofob = _composed(composed, "1f1b")[2].memory_analysis().temp_size_in_bytes
    print(f"per-device temp bytes at m=8, p=2: gpipe {gpipe}, 1f1b {ofob} ({ofob / gpipe:.3f}x)")
    assert ofob <= 0.5 * gpipe


def test_1f1b_skips_idle_work_with_conditionals(composed):
    # forward, head and backward parts of the tick each sit in a conditional (same predicate on every device)
    text = _composed(composed, "1f1b")[2].as_text()
    assert not re.findall(r"\bconditional\(", _composed(composed, "gpipe")[2].as_text())  # none outside 1f1b's ticks
    assert len(re.findall(r"\bconditional\(", text)) >= 3


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_checkpoint_round_trip_across_stage_counts(baseline, tmp_path):
    """One pp(2) step, then pp(2) -> fsdp(8) -> pp(4) -> pp(2) through checkpoints (the global layer
    layout): each restore bit-exact and on the new mesh; the next pp(2) step gives the same loss and
    state as without the round trip, and the losses are the one-device ones. pp(2) is the composed gpipe
    run's recipe (stage=2 × fsdp=2 × tensor=2): its train step is compiled once for both tests."""
    abstract = _abstract()
    first = mt.get_recipe("pp_fsdp_tp").with_options(schedule="gpipe", pipeline_micro_batches=8, repeats=1)
    plans = [mt.make_plan(abstract, r, r.mesh.build(jax.devices()), batch=mt.BatchSpec(B, T))
             for r in (first, mt.get_recipe("fsdp"), mt.get_recipe("pp").with_mesh(stage=4, data=2))]
    plans.append(plans[0])
    step = mt.make_train_step(plans[0])
    state, m0 = step(_initial(plans[0]), put(token_batch(0, B, T), plans[0]))
    saved = host(state)
    for i, plan in enumerate(plans[1:], 1):
        with Checkpointer(tmp_path / f"c{i}", save_every=1) as ckpt:
            ckpt.maybe_save(i, state, data_state={}, metadata={})
            ckpt.wait()
            restored = ckpt.restore(plan).state
        assert_bit_exact(saved, restored)
        assert_on_mesh(restored, plan)
        state = restored
    resumed, m1 = step(state, put(token_batch(1, B, T), plans[0]))
    direct, m1_direct = step(jax.device_put(saved, mt.state_shardings(plans[0])), put(token_batch(1, B, T), plans[0]))
    assert float(m1["loss"]) == float(m1_direct["loss"])
    assert_bit_exact(host(direct), resumed)
    losses = [float(m0["loss"]), float(m1["loss"])]
    assert rel_diff(losses, baseline[1][:2]) <= 1e-5, (losses, baseline[1][:2])
