"""Cross-check of the per-op HLO cost (meshtrain/analysis/hlo_cost.py) on XLA:CPU compiled steps.

For each model × recipe: the step compiled for 4 simulated CPU devices; its classified dot FLOPs
(matmul + attention, one device) against ``compiled.cost_analysis()["flops"]`` (XLA counts a while
body once and counts element-wise FLOPs too) and against the planner's analytic executed FLOPs
per device (meshtrain.analysis.steptime.executed_flops)::

    JAX_NUM_CPU_DEVICES=4 python tools/hlo_cost_check.py [--models tiny small] [--recipes dp fsdp fsdp_tp]
"""

import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.analysis.hlo_cost import hlo_cost  # noqa: E402
from meshtrain.analysis.lowering import compile_local  # noqa: E402
from meshtrain.analysis.steptime import _step_flops, executed_flops  # noqa: E402
from meshtrain.models import get_config, model_factory  # noqa: E402


def row(model: str, recipe_name: str, remat: str, devices: int = 4, batch: int = 8, seq: int = 32):
    cfg = get_config(model)
    recipe = mt.get_recipe(recipe_name).with_options(remat=remat)
    abstract = mt.abstract_state(model_factory(cfg), optax.adamw(1e-4))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:devices]), batch=mt.BatchSpec(batch, seq))
    compiled = compile_local(plan)
    xla = compiled.cost_analysis()
    xla = (xla[0] if isinstance(xla, (list, tuple)) else xla)["flops"]
    cost = hlo_cost(compiled.as_text())
    analytic = executed_flops(plan, cfg, _step_flops(cfg, batch, seq, plan.recipe.remat))[0] / devices
    return {"model": model, "recipe": recipe_name, "remat": remat, "hlo_dot_flops": cost.dot_flops,
            "attention_share": cost.attention_flops / cost.dot_flops, "xla_flops": xla, "analytic_flops": analytic,
            "hlo_vs_xla": cost.dot_flops / xla, "hlo_vs_analytic": cost.dot_flops / analytic,
            "loops": [(lp.trips, lp.how) for lp in cost.loops], "memory_bytes": cost.memory_bytes,
            "collective_bytes": cost.collective_bytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--recipes", nargs="+", default=["dp", "fsdp", "fsdp_tp"])
    ap.add_argument("--remat", nargs="+", default=["none", "full"])
    args = ap.parse_args()
    print("| model | recipe | remat | HLO dot FLOPs/device | attention share | ÷ XLA cost_analysis | ÷ analytic | loops |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.models:
        for r in args.recipes:
            for remat in args.remat:
                x = row(m, r, remat)
                print(f"| {m} | {r} | {remat} | {x['hlo_dot_flops']:.4g} | {x['attention_share']:.1%} | "
                      f"{x['hlo_vs_xla']:.3f} | {x['hlo_vs_analytic']:.3f} | {x['loops']} |", flush=True)


if __name__ == "__main__":
    main()
