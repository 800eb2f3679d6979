"""``meshtrain plan``: the sharding plan of a model under a recipe, before anything runs, with the
per-device memory (fits or not), collectives per mesh axis, step time and MFU on a chosen chip,
and the usual warnings. ``--recipe auto`` searches recipes × meshes × remat × micro-batches.

    meshtrain plan --model small --recipe fsdp --devices 8
    meshtrain plan --model llama3-70b --recipe auto --devices 256 --hardware tpu-v5p
    meshtrain plan --model llama3-8b --recipe fsdp_tp --mesh fsdp=32,tensor=8 --devices 256 --hardware h100 --json

More devices than this machine has are planned on an ``AbstractMesh`` (no devices simulated);
``--check compile`` compiles locally (≤ 8 devices) and prints the estimates next to XLA's numbers.
"""

from __future__ import annotations

import json
import os

from meshtrain.cli import add_device_args

#: Up to this many CPU devices are simulated for a plan; beyond it the plan is abstract (analytic).
LOCAL_SIMULATION_LIMIT = 8
CHECKS = ("none", "compile", "lower", "tpu")


def add_parser(sub):
    p = sub.add_parser("plan", help="show how a model is laid out on the mesh, its memory, collectives and "
                                    "step time (no training)")
    p.add_argument("--model", default="tiny", help="model config name (tiny, small, llama3-8b, ...)")
    p.add_argument("--recipe", default="fsdp", help="recipe name, .yaml file, or 'auto' to search all built-ins")
    p.add_argument("--mesh", default=None, help="override mesh sizes, e.g. fsdp=4,tensor=2")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch (default: data-parallel size; with --recipe auto: one per device)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: model max)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None,
                   help="matmul dtype (default: the recipe's on cpu, bfloat16 on accelerators)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default=None,
                   help="override the recipe's remat policy (auto searches none, dots_no_batch, full)")
    p.add_argument("--micro-batches", type=int, default=None, help="override gradient accumulation steps")
    p.add_argument("--hardware", default="cpu",
                   help="chip to estimate for: h100, h200, a100, b200, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, cpu")
    p.add_argument("--top", type=int, default=8, help="with --recipe auto: how many ranked layouts to print")
    p.add_argument("--check", choices=CHECKS, default="none",
                   help="compile: compile here and compare with XLA (≤ 8 devices); lower: lower on an "
                        "AbstractMesh for the target platform; tpu: compile for a fake TPU topology (needs libtpu)")
    p.add_argument("--topology", default=None,
                   help="with --check tpu: fake TPU topology, e.g. v5e:4x4 or v5p:2x2x2 (default: from "
                        "--hardware and --devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    add_device_args(p)
    p.set_defaults(run=run, setup_devices=False)


def _apply_options(recipe, args):
    from meshtrain.mesh import MeshSpec

    if getattr(args, "mesh", None):
        recipe = recipe.with_mesh(**MeshSpec.parse(args.mesh))
    changes = {}
    for flag, field in (("param_dtype", "param_dtype"), ("compute_dtype", "compute_dtype"), ("remat", "remat"),
                        ("micro_batches", "micro_batches")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[field] = value
    return recipe.with_options(**changes) if changes else recipe


def build_plan(args):
    """Recipe + mesh + abstract model → ``ShardingPlan`` (shared with the planner).

    More devices than exist (``--devices`` beyond this machine) → the plan lives on an AbstractMesh.
    """
    import jax
    import optax

    from meshtrain.abstract import abstract_state
    from meshtrain.models import get_config, model_factory
    from meshtrain.plan import BatchSpec, make_plan
    from meshtrain.recipes import get_recipe

    cfg = get_config(args.model)
    recipe = _apply_options(get_recipe(args.recipe), args)
    hardware = getattr(args, "hardware", "cpu") or "cpu"
    if hardware != "cpu" and getattr(args, "compute_dtype", None) is None:
        recipe = recipe.with_options(compute_dtype="bfloat16")  # accelerator peaks are bf16 figures
    n = args.devices or len(jax.devices())
    if n <= len(jax.devices()):
        mesh = recipe.mesh.build(jax.devices()[:n])
    else:  # more devices than this machine has (an accelerator host asked for a pod): plan abstractly
        mesh = recipe.mesh.abstract(n)
    abstract = abstract_state(model_factory(cfg), optax.adamw(1e-3))
    probe = make_plan(abstract, recipe, mesh, check=False)
    dp = probe.data_parallel_size * recipe.micro_batches
    batch = BatchSpec(args.batch_size or dp, args.seq_len or cfg.max_seq_len)
    return make_plan(abstract, recipe, mesh, batch=batch)


def _setup(args) -> None:
    from meshtrain.cli import setup_devices

    n = args.devices
    if n is not None and n < 1:
        setup_devices(n)  # raises the usual error
    if n is None or n <= LOCAL_SIMULATION_LIMIT or "JAX_NUM_CPU_DEVICES" in os.environ:
        setup_devices(n)
    else:
        setup_devices(None)  # keep the default simulated devices; the plan itself is abstract


def run(args) -> int:
    from meshtrain.analysis import report
    from meshtrain.models import get_config

    _setup(args)
    cfg = get_config(args.model)
    if args.recipe == "auto":
        result = report.auto(args, cfg)
        out = report.auto_dict(result, args) if args.json else report.auto_text(result, args)
    else:
        plan = build_plan(args)
        out = report.single_dict(plan, cfg, args) if args.json else report.single_text(plan, cfg, args)
    print(json.dumps(out, default=str) if args.json else out)
    return 0
