"""``meshtrain plan``: the sharding plan of a model under a recipe, before anything runs."""

from __future__ import annotations

import json

from meshtrain.cli import add_device_args


def add_parser(sub):
    p = sub.add_parser("plan", help="show how a model is laid out on the mesh (no training)")
    p.add_argument("--model", default="tiny", help="model config name (tiny, small, llama3-8b, ...)")
    p.add_argument("--recipe", default="fsdp", help="recipe name or .yaml file")
    p.add_argument("--mesh", default=None, help="override mesh sizes, e.g. fsdp=4,tensor=2")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: data-parallel size)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: model max)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_device_args(p)
    p.set_defaults(run=run)


def build_plan(args):
    """Recipe + mesh + abstract model → ``ShardingPlan`` (shared with the planner)."""
    import jax
    import optax

    from meshtrain.abstract import abstract_state
    from meshtrain.mesh import MeshSpec
    from meshtrain.models import get_config, model_factory
    from meshtrain.plan import BatchSpec, make_plan
    from meshtrain.recipes import get_recipe

    cfg = get_config(args.model)
    recipe = get_recipe(args.recipe)
    if args.mesh:
        recipe = recipe.with_mesh(**MeshSpec.parse(args.mesh))
    if args.param_dtype:
        recipe = recipe.with_options(param_dtype=args.param_dtype)
    n = args.devices or len(jax.devices())
    if n <= len(jax.devices()):
        mesh = recipe.mesh.build(jax.devices()[:n])
    else:  # more devices than this machine has (an accelerator host asked for a pod): plan abstractly
        mesh = recipe.mesh.abstract(n)
    abstract = abstract_state(model_factory(cfg), optax.adamw(1e-3))
    dp = 1
    probe = make_plan(abstract, recipe, mesh, check=False)
    dp = probe.data_parallel_size * recipe.micro_batches
    batch = BatchSpec(args.batch_size or dp, args.seq_len or cfg.max_seq_len)
    return make_plan(abstract, recipe, mesh, batch=batch)


def run(args) -> int:
    plan = build_plan(args)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(plan.describe())
    return 0
