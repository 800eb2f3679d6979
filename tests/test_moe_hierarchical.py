"""The hierarchical expert all-to-all (issue 33, item 1): an `expert` axis of 2 "slices" × ICI on 8 CPU devices.

* the two-level exchange equals the flat all-to-all row for row (a bare shard_map, fast);
* a train step's loss and gradients equal the flat exchange's within 1e-6 (f32) under fsdp_ep and fsdp_tp_ep, with
  capacity and dropless routing, on the same hybrid mesh;
* the compiled HLO has two exchange levels, replica groups inside one slice and across slices;
* the planner's DCN bytes (flat / hierarchical by the factor it predicts: the tensor ranks' shares) equal the compiled
  all-to-alls' within 10 %;
* hierarchical is refused (typed error, no traceback) where the expert axis does not cross DCN;
* with libtpu (not installed in the suite's environment: skipped there), an XLA:TPU compile for two v5e:2x2 slices.
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import processes
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.analysis import hlo_collectives
from meshtrain.analysis.collectives import _replica_groups
from meshtrain.analysis.exchange import compiled_dcn, slice_of_positions
from meshtrain.analysis.moe import exchange_dcn
from meshtrain.analysis.steptime import estimate_step_time
from meshtrain.errors import ConfigError
from meshtrain.parallel.moe_exchange import ExpertExchange, exchange
from meshtrain.parallel.resolved import resolve_step
from meshtrain.strategies import AllToAll, Expert

from helpers import host, put, rel_diff, tiny_abstract, token_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 16, 32
NO_DROP = 4.0  # capacity factor n_experts / top_k: nothing drops
#: 2 slices × 4 devices; the expert axis crosses the slice boundary (DCN 2) and has 2 devices inside each slice
LAYOUTS = {"fsdp_ep": {"fsdp": 2, "expert": 2}, "fsdp_tp_ep": {"fsdp": 1, "expert": 2, "tensor": 2}}


def _recipe(name, all_to_all, dcn=True):
    recipe = mt.get_recipe(name).with_options(all_to_all=all_to_all)
    if not dcn:  # the same total sizes, all inside one slice
        return recipe.with_mesh(**{**LAYOUTS[name], "expert": 2 * LAYOUTS[name]["expert"]})
    return recipe.with_mesh(dcn={"expert": 2}, **LAYOUTS[name])


def _plan(name, all_to_all, capacity_factor, devices=None, dcn=True, tx=None):
    recipe = _recipe(name, all_to_all, dcn)
    mesh = recipe.mesh.build(devices if devices is not None else jax.devices())
    abstract = tiny_abstract(tx, model="tiny-moe", capacity_factor=capacity_factor)
    return mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(B, T))


# -- the exchange itself -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,names,slices", [((8,), ("expert",), 2), ((2, 4), ("fsdp", "expert"), 2),
                                                 ((8,), ("expert",), 4)], ids=["8=2x4", "fsdp2-expert4=2x2", "8=4x2"])
def test_two_level_exchange_equals_the_flat_all_to_all(shape, names, slices):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    ep = mesh.shape["expert"]
    ex = ExpertExchange(AllToAll.HIERARCHICAL, ("expert",), slices, ep // slices)
    x = jnp.arange(np.prod(shape) * ep * 3 * 2, dtype=jnp.float32).reshape(np.prod(shape) * ep, 3, 2)
    spec = P(names)

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(lambda v: fn(v.reshape((ep, -1) + v.shape[1:])).reshape(v.shape),
                                                mesh=mesh, in_specs=spec, out_specs=spec))(x))

    flat = run(lambda v: jax.lax.all_to_all(v, "expert", 0, 0, tiled=True))
    assert np.array_equal(run(lambda v: exchange(v, ex)), flat)
    assert not np.array_equal(flat, np.asarray(x))  # the exchange moved rows


# -- refusals ----------------------------------------------------------------------------------------------------

def test_hierarchical_without_a_dcn_expert_axis_is_refused():
    plan = _plan("fsdp_ep", "hierarchical", NO_DROP, dcn=False)
    with pytest.raises(ConfigError, match="spans slices/nodes .*--all-to-all flat"):
        resolve_step(plan)
    assert resolve_step(_plan("fsdp_ep", "flat", NO_DROP, dcn=False)).expert_exchange.kind is AllToAll.FLAT
    ex = resolve_step(_plan("fsdp_ep", "hierarchical", NO_DROP)).expert_exchange
    assert (ex.kind, ex.expert_axes, ex.slices, ex.per_slice) == (AllToAll.HIERARCHICAL, ("expert",), 2, 2)


def test_cli_refuses_hierarchical_without_dcn_and_plans_it_with_dcn(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"

    def plan(*args):
        return processes.run([sys.executable, "-m", "meshtrain", "plan", "--model", "tiny-moe", "--devices", "8",
                              *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)

    out = plan("--recipe", "fsdp_tp_ep", "--all-to-all", "hierarchical")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "all_to_all=hierarchical needs an expert axis that spans slices" in out.stderr
    path = tmp_path / "two_slices.yaml"
    path.write_text("name: fsdp_tp_ep_2slices\nstrategies: [dp, fsdp, tp, ep]\nmesh:\n"
                    "  ici: {data: 1, fsdp: 1, expert: 2, tensor: 2}\n  dcn: {expert: 2}\n")
    out = plan("--recipe", str(path), "--all-to-all", "hierarchical", "--hardware", "tpu-v5p", "--slices", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"expert \(dcn\)\s+slow", out.stdout) and re.search(r"expert \(ici\)\s+fast", out.stdout)
    assert "hierarchical: all-to-all inside each of 2 slices" in out.stdout
    assert "bytes ÷2.00, messages ÷2.00; this plan: hierarchical" in out.stdout


def test_the_option_is_one_setting_for_python_yaml_set_and_the_flag():
    from meshtrain.train.run_config import RunConfig

    recipe = mt.get_recipe("fsdp_tp_ep").with_options(all_to_all="hierarchical")
    assert recipe.dimension(Expert).all_to_all is AllToAll.HIERARCHICAL
    from_file = mt.get_recipe(os.path.join(ROOT, "recipes", "fsdp_tp_ep_2slices.yaml"))
    assert from_file.dimension(Expert).all_to_all is AllToAll.HIERARCHICAL and dict(from_file.mesh.dcn) == {"expert": 2}
    cfg = RunConfig().with_values({"recipe.name": "fsdp_tp_ep", "recipe.options.all_to_all": "hierarchical"})
    assert ("all_to_all", "hierarchical") in cfg.train_config().recipe_options
    with pytest.raises(ConfigError, match="all_to_all='sideways': use one of"):
        cfg.with_values({"recipe.options.all_to_all": "sideways"})


# -- the planner alone ---------------------------------------------------------------------------------------------

def test_planner_prices_the_levels_on_their_links_and_predicts_the_dcn_factors():
    cfg = mt.models.get_config("tiny-moe", capacity_factor=NO_DROP)
    for name, tensor in (("fsdp_ep", 1), ("fsdp_tp_ep", 2)):
        hier = _plan(name, "hierarchical", NO_DROP)
        dcn = exchange_dcn(hier, cfg, "cpu")
        # the same buffer either way: DCN bytes ÷ tensor ranks (PCC), DCN messages ÷ devices per slice
        assert dcn["bytes_factor"] == pytest.approx(tensor) and dcn["messages_factor"] == pytest.approx(2)
        assert dcn["flat"]["messages"] == 4 * (2 - 1) * 2 and dcn["hierarchical"]["messages"] == 4 * (2 - 1)
        assert dcn == exchange_dcn(_plan(name, "flat", NO_DROP), cfg, "cpu") | {"all_to_all": "hierarchical"}
        rows = {a.axes: a for a in estimate_step_time(hier, cfg, "tpu-v5p").axes}
        assert rows["expert (ici)"].link.value == "fast" and rows["expert (dcn)"].link.value == "slow"


# -- train steps: parity, HLO levels, compiled DCN bytes -----------------------------------------------------------

_RUNS = {}


def _step(name, all_to_all, capacity_factor):
    """Loss, step-0 gradients, the plan and the compiled step of one hybrid-mesh train step (cached per case)."""
    key = (name, all_to_all, capacity_factor)
    if key not in _RUNS:
        keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
        # the optimizer only keeps the gradients (one step is compared: an AdamW update would be compiled unread)
        plan = _plan(name, all_to_all, capacity_factor, tx=keep)
        # every case has the same parameter shapes: initialised once, then resharded (no init program per case)
        if "initial" not in _RUNS:
            _RUNS["initial"] = host(mt.init_state(plan, seed=0))
        state = jax.device_put(_RUNS["initial"], mt.state_shardings(plan))
        compiled = mt.make_train_step(plan).lower(state, put(token_batch(0, B, T), plan)).compile()
        state, metrics = compiled(state, put(token_batch(0, B, T), plan))
        grads = {path_str(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]}
        _RUNS[key] = (float(metrics["loss"]), grads, plan, compiled)
    return _RUNS[key]


#: Each case compiles the flat and the hierarchical step. The hierarchical code paths: the capacity kernel's
#: exchange (_capacity_exchanged) and the dropless kernel's (both through TokenExchange), and TokenExchange with
#: PCC (tensor ranks, fsdp_tp_ep) and without (fsdp_ep). Three cases cover each kernel with PCC and each PCC
#: choice with the capacity kernel; the fourth of the product (fsdp_ep × dropless) runs no code the others do
#: not (the kernels are generic over the width PCC sends), for two more compiles.
CASES = [("fsdp_ep", NO_DROP), ("fsdp_tp_ep", NO_DROP), ("fsdp_tp_ep", None)]
IDS = ["fsdp_ep-capacity", "fsdp_tp_ep-capacity", "fsdp_tp_ep-dropless"]


@pytest.mark.slow
@pytest.mark.parametrize("name,capacity_factor", CASES, ids=IDS)
def test_hierarchical_step_equals_flat(name, capacity_factor):
    loss_flat, grads_flat, *_ = _step(name, "flat", capacity_factor)
    loss_hier, grads_hier, *_ = _step(name, "hierarchical", capacity_factor)
    assert abs(loss_hier - loss_flat) <= 1e-6 * abs(loss_flat), (loss_hier, loss_flat)
    assert grads_hier.keys() == grads_flat.keys()
    for path, g in grads_hier.items():
        assert rel_diff(g, grads_flat[path]) <= 1e-6, path
    assert any(np.any(g != 0) for g in grads_hier.values())


def _a2a_levels(plan, compiled):
    """The compiled all-to-alls' replica groups, classified against the slices of the plan's mesh."""
    slices = slice_of_positions(plan)
    levels = set()
    for c in hlo_collectives(compiled.as_text(), plan.mesh):
        if c.kind != "all-to-all":
            continue
        for group in _replica_groups(c.line):
            seen = [slices[p] for p in group]
            levels.add("inside" if len(set(seen)) == 1 else "across" if len(set(seen)) == len(seen) else "mixed")
    return levels


@pytest.mark.slow
@pytest.mark.parametrize("name,capacity_factor", CASES, ids=IDS)
def test_compiled_levels_and_dcn_bytes_match_the_planner(name, capacity_factor):
    cfg = mt.models.get_config("tiny-moe", capacity_factor=capacity_factor)
    measured = {}
    for form in ("flat", "hierarchical"):
        *_, plan, compiled = _step(name, form, capacity_factor)
        measured[form] = compiled_dcn(hlo_collectives(compiled.as_text(), plan.mesh), slice_of_positions(plan))
        planned = exchange_dcn(plan, cfg, "cpu")[form]
        for what in ("bytes", "messages"):
            got, want = measured[form][what], planned[what] * cfg.n_layers
            assert abs(got - want) <= 0.1 * want, (form, what, got, want)
        assert _a2a_levels(plan, compiled) == ({"mixed"} if form == "flat" else {"inside", "across"}), form
    predicted = exchange_dcn(plan, cfg, "cpu")
    factor = measured["flat"]["bytes"] / measured["hierarchical"]["bytes"]
    assert factor == pytest.approx(predicted["bytes_factor"], rel=0.1)
    assert factor == pytest.approx(2.0 if name == "fsdp_tp_ep" else 1.0, rel=0.1)  # the tensor ranks' shares
    assert measured["flat"]["messages"] / measured["hierarchical"]["messages"] == pytest.approx(2.0)


# -- XLA:TPU, two slices (needs libtpu) ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_ep", "fsdp_tp_ep"])
def test_tpu_two_slice_compile_has_an_ici_all_to_all_and_a_per_slice_pair_dcn_transfer(name):
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    from meshtrain.analysis.collectives import _type_bytes
    from meshtrain.analysis.compiled import step_inputs

    devices = list(topologies.get_topology_desc("v5e:2x2", "tpu", num_slices=2).devices)
    groups, sent = {}, {}
    for form in ("flat", "hierarchical"):
        plan = _plan(name, form, 1.25, devices=devices)
        state, batch = step_inputs(plan)
        text = mt.make_train_step(plan).lower(state, batch).compile().as_text()
        # XLA:TPU compiles one slice's program: a cross-slice exchange becomes a megascale (DCN) ALL_TO_ALL transfer
        # (a host-transfer `send` whose target lists the device ids of each group)
        dcn = [line for line in text.splitlines() if " send(" in line and 'transfer_type="ALL_TO_ALL"' in line]
        groups[form] = {len(re.findall(r"\d+", g)) for line in dcn
                        for g in re.findall(r"\{([\d,]+)\}", re.search(r"_xla_megascale_target=(\{\{.*?\}\})",
                                                                         line).group(1))}
        sent[form] = sum(_type_bytes(line.split(" send(")[0].split("=", 1)[1].split(", u32")[0])[0] for line in dcn)
        inside = [c for c in hlo_collectives(text) if c.kind == "all-to-all"]
        assert bool(inside) == (form == "hierarchical") and all(c.group_size == 2 for c in inside), form
    assert groups == {"flat": {4}, "hierarchical": {2}}  # flat: 2 devices of each slice; hierarchical: 1 of each
    # bytes handed to the DCN transfers: the tensor ranks' shares (PCC) halve them under fsdp_tp_ep
    assert sent["flat"] == sent["hierarchical"] * (2 if name == "fsdp_tp_ep" else 1)
