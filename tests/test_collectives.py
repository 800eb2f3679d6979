"""What crosses the wires, read from the compiled HLO of each recipe's train step.

XLA:CPU emits all-reduce + dynamic-slice where GPU/TPU emit reduce-scatter, and counts ops inside
the layer loop once; so these tests assert kinds, mesh axes and tensor shapes, not exact counts.
"""

import re

import jax
import pytest

import meshtrain as mt
from meshtrain.analysis import hlo_collectives
from meshtrain.analysis.compiled import step_inputs

from helpers import mesh_for, tiny_abstract

B, T = 16, 64


def compile_step(name):
    recipe, mesh = mesh_for(name)
    recipe = recipe.with_options(layer_loop="scan")  # the assertions read the layer scan's loop carry
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(B, T))
    # lowered from shapes (nothing initialised: an init program per recipe would be a compile checking nothing)
    compiled = mt.make_train_step(plan).lower(*step_inputs(plan)).compile()
    return plan, compiled.as_text(), hlo_collectives(compiled.as_text(), mesh)


def _dims(shape_str):
    return tuple(int(d) for d in re.search(r"\[([0-9,]*)\]", shape_str).group(1).split(",") if d)


def _weight_shapes(plan):
    """Full per-layer and whole shapes of every parameter."""
    shapes = set()
    for leaf in plan.group("params"):
        shapes.add(leaf.shape)
        if leaf.logical_axes and leaf.logical_axes[0] == "layers":
            shapes.add(leaf.shape[1:])
    return shapes


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assertions written for XLA:CPU")
def test_dp_all_reduces_gradients_and_gathers_nothing():
    plan, _, cs = compile_step("dp")
    kinds = {c.kind for c in cs}
    assert kinds == {"all-reduce"}
    assert all(c.axes == ("data",) for c in cs)
    # Every gradient crosses once (per-layer gradients inside the layer loop: one layer's shape;
    # XLA may transpose dims, so compare sorted dims).
    reduced = {tuple(sorted(_dims(s))) for c in cs for s in c.shapes}
    for leaf in plan.group("params"):
        shape = leaf.shape[1:] if leaf.logical_axes[0] == "layers" else leaf.shape
        assert tuple(sorted(shape)) in reduced, f"gradient of {leaf.path} {shape} is not all-reduced"


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assertions written for XLA:CPU")
def test_fsdp_all_gathers_every_layer_weight():
    plan, _, cs = compile_step("fsdp")
    gathered = {_dims(s) for c in cs if c.kind == "all-gather" for s in c.shapes}
    assert all(c.axes == ("fsdp",) for c in cs)
    for leaf in plan.group("params"):
        if leaf.path.startswith("blocks/") and leaf.path.endswith(("_dnh", "_dkh", "_nhd", "_df", "_fd")):
            assert leaf.shape[1:] in gathered, f"{leaf.path} per-layer weight {leaf.shape[1:]} never all-gathered"
    # Gradients go back sharded: a reduction over fsdp (reduce-scatter, or all-reduce + slice on CPU).
    assert any(c.kind in ("reduce-scatter", "all-reduce") and c.axes == ("fsdp",) for c in cs)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assertions written for XLA:CPU")
def test_tp_moves_activations_not_weights():
    plan, _, cs = compile_step("tp")
    weights = _weight_shapes(plan)
    assert all(c.axes == ("tensor",) for c in cs)
    moved = [_dims(s) for c in cs for s in c.shapes]
    assert not [s for s in moved if s in weights and len(s) > 1], "a weight crossed the tensor axis"
    assert (B, T, 64) in moved  # the row-parallel output all-reduce of the residual stream


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="assertions written for XLA:CPU")
def test_sequence_parallel_keeps_residual_stream_sharded_on_sequence():
    _, text_sp, cs_sp = compile_step("fsdp_tp_sp")
    _, text_tp, _ = compile_step("fsdp_tp")
    b_local = B // 4  # fsdp=4, tensor=2

    def layer_carry(text):  # the first loop-carried activation of the layer scan (forward pass)
        m = re.search(r"= \(s32\[\], (f32\[[0-9,]+\])", text)
        return _dims(m.group(1))

    assert layer_carry(text_tp) == (b_local, T, 64)
    assert layer_carry(text_sp) == (b_local, T // 2, 64)
    # Entering attention/MLP gathers the sequence over `tensor` (activations, not weights).
    assert any(c.kind == "all-gather" and c.axes == ("tensor",) and (b_local, T, 64) in map(_dims, c.shapes)
               for c in cs_sp)
