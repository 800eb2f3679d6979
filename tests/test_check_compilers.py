"""tools/check_compilers.py's table covers every built-in recipe, attention kind and pipeline schedule (issue 24).

``--list`` compiles nothing, so these run without libtpu or the XLA:GPU plugin.
"""

import os
import re
import sys

import processes
import pytest

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "check_compilers.py")


def listed(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    out = processes.run([sys.executable, TOOL, "--list", *args], capture_output=True, text=True, env=env,
                        timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def table():
    """``{label: (flags, model text)}`` of the full TPU table."""
    rows = {}
    for line in listed():
        m = re.fullmatch(r"(?P<label>.+?): meshtrain plan --check tpu (?P<flags>.*) \(model (?P<model>.*)\)", line)
        assert m, line
        rows[m.group("label")] = (m.group("flags").split(), m.group("model"))
    return rows


def _recipe(flags):
    return flags[flags.index("--recipe") + 1]


def test_the_full_table_has_every_builtin_recipe_at_the_issue_shapes(table):
    from meshtrain.recipes import BUILTIN_RECIPES

    assert {_recipe(flags) for flags, _ in table.values()} == set(BUILTIN_RECIPES)
    assert len(table) == 38
    for label, (flags, model) in table.items():  # Llama-3-8B at 4 layers; Mixtral for the expert recipes
        expected = "mixtral-8x7b" if "ep" in _recipe(flags).split("_") else "llama3-8b"
        assert model.startswith(expected + ",") and "n_layers=4" in model, (label, model)


@pytest.mark.parametrize("recipe, option, values", [
    ("pp", "--schedule", {"gpipe", "circular", "1f1b"}),
    ("pp_fsdp", "--schedule", {"gpipe", "circular", "1f1b"}),
    ("pp_fsdp_tp", "--schedule", {"gpipe", "circular", "1f1b"}),
    ("cp", "--context-kind", {"all_gather", "ring", "ulysses"}),
    ("fsdp_cp", "--context-kind", {"all_gather", "ulysses", None}),  # None: the recipe's own, ring
    ("fsdp_tp_cp", "--context-kind", {"ring", "ulysses", None}),  # None: the recipe's own, all_gather
    ("fsdp", "--local-attention", {"flash", None}),
    ("fsdp_tp", "--local-attention", {"flash", None}),
])
def test_each_schedule_and_attention_kind_of_a_recipe_is_a_case(table, recipe, option, values):
    got = {flags[flags.index(option) + 1] if option in flags else None
           for flags, _ in table.values() if _recipe(flags) == recipe}
    assert got == values


@pytest.mark.parametrize("recipe", ["ep", "fsdp_ep", "fsdp_tp_ep"])
def test_expert_recipes_run_with_capacity_and_dropless(table, recipe):
    models = sorted(model for flags, model in table.values() if _recipe(flags) == recipe)
    assert len(models) == 2 and "capacity_factor=None" in models[0] and "capacity_factor" not in models[1], models


def test_quick_is_the_ten_small_cases_and_gpu_lists_its_own():
    quick = listed("--quick")
    assert len(quick) == 10 and all(line.endswith("(model small)") for line in quick), quick
    assert any(line.startswith("fsdp_cp ulysses splash: meshtrain plan --check tpu") for line in quick)
    gpu = listed("--gpu")
    assert all(": meshtrain plan --check gpu --topology 8xH100 --recipe " in line for line in gpu), gpu
