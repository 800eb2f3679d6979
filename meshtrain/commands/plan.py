"""``meshtrain plan``: the sharding plan of a model under a recipe, before anything runs, with the
per-device memory (fits or not), collectives per mesh axis, step time and MFU on a chosen chip,
and the usual warnings. ``--recipe auto`` searches recipes × meshes × remat × micro-batches.

    meshtrain plan --model small --recipe fsdp --devices 8
    meshtrain plan --model llama3-70b --recipe auto --devices 256 --hardware tpu-v5p
    meshtrain plan --model llama3-405b --recipe auto --devices 512 --hardware tpu-v5p --slices 2 --batch-size 512
    meshtrain plan --model llama3-8b --recipe fsdp_tp --mesh fsdp=32,tensor=8 --devices 256 --hardware h100 --json
    meshtrain plan --model vit-tiny --recipe fsdp --batch-size 64
    meshtrain plan --model mymodels:make_mlp --batch x=64x32:float32,y=64:int32 --loss mymodels:mlp_loss

``--model`` means what it means for ``meshtrain train`` (:mod:`meshtrain.model_source`): a built-in
config name, a HuggingFace folder (``config.json``: the decoder it describes), a run folder (the model
it trained, e.g. one ``meshtrain import`` wrote; ``--recipe auto`` searches for it too), or
``module:function``: an importable function that takes one argument, ``rngs`` (an ``nnx.Rngs``), and
returns an ``nnx.Module`` whose parameters carry logical axis names (``module`` may also be a
``path/to/file.py``, whose folder is then importable too, so the file may import its neighbours; the
current directory is importable). ``--rules FILE.yaml`` gives a model you
did not write its logical axes (``paths:``) and maps its own logical names (``logical:``);
``--list-params`` prints every parameter's path, shape, dtype and logical names to write them against,
then the model state (batch statistics, RNG streams: path rules may name it too).
``--batch`` describes the global batch for any model: comma-separated ``name=DIMS[:dtype][@axes]``,
``DIMS`` like ``16x8x8x1`` (the leading dimension is the batch), ``dtype`` default ``float32``,
``axes`` one logical name per dimension separated by ``/`` (``-`` for none; default ``batch`` on
the leading dimension), a ``/`` in ``name`` nests (``a/b=...``). Built-in models have default batches
(decoder: ``inputs, targets, positions, segment_ids`` ``(B, T)`` int32; ViT: ``images`` ``(B, H, W, C)``
float32 + ``labels`` ``(B,)`` int32; BERT: ``input_ids, targets, positions, segment_ids`` ``(B, T)``
int32). ``--loss module:function`` names ``(model, batch) -> (loss_sum, weight[, metrics])``; a
decoder gets the analytic estimates, any other model estimates from its compiled train step (a
mesh of this machine's devices) or its traced one (more devices: an AbstractMesh), which need its
loss (built-ins have one); without a loss a user model gets the plan and its state's memory only.

More devices than this machine has are planned on an ``AbstractMesh`` (no devices simulated);
``--check compile`` compiles locally (≤ 8 devices) and prints the estimates next to XLA's numbers;
``--check tpu`` compiles for a fake TPU topology (the ``tpu`` extra) and ``--check gpu --topology
8xH100`` for compile-only NVIDIA GPUs (the ``gpu-aot`` extra, :mod:`meshtrain.analysis.gpu_aot`), on any host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Dict, Optional

from meshtrain import fp8
from meshtrain.parallel import grad_compression
from meshtrain.abstract import abstract_state, list_model_state, list_params
from meshtrain.analysis import gpu_aot
from meshtrain.annotate import ModelRules
from meshtrain.batch_layout import BatchLayout, BatchSpec
from meshtrain.commands.common import add_device_args, setup_devices
from meshtrain.commands.recipe_flags import recipe_overrides
from meshtrain.commands.run_flags import add_run_flags, resolve, write_back
from meshtrain.data.mlm import KEYS
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.mesh import MeshSpec
from meshtrain.model_source import FACTORY_CONTRACT, LOSS_CONTRACT, check_arity, load_ref, model_source
from meshtrain.models import BertConfig, DecoderConfig, ViTConfig
from meshtrain.models.lora import lora_factory
from meshtrain.parallel.context import check_seq_len as check_context_seq_len
from meshtrain.parallel.resolved import batch_splits
from meshtrain.plan import fmt_bytes, make_plan
from meshtrain.recipes import get_recipe
from meshtrain.train.config import (AdamVariance, TrainConfig, check_recipe_overrides, default_optimizer,
                                    fitted_batch_size)
from meshtrain.train.metrics import hardware_of
from meshtrain.train.run_config import setting_at

#: Up to this many CPU devices are simulated for a plan; beyond it the plan is abstract (analytic).
LOCAL_SIMULATION_LIMIT = 8
CHECKS = ("none", "compile", "lower", "tpu", "gpu")


def add_parser(sub):
    p = sub.add_parser("plan", help="show how a model is laid out on the mesh, its memory, collectives and "
                                    "step time (no training)")
    # --model, --rules, --recipe (or auto), --mesh and the recipe's flags: the run configuration's (the same
    # names, help and defaults as `meshtrain train`), with --config and --set
    add_run_flags(p, PLAN_FLAG_KEYS, recipe_options=True, with_defaults=True)
    p.add_argument("--list-params", action="store_true", help=LIST_PARAMS_HELP)
    p.add_argument("--batch", default=None,
                   help="the global batch for any model: name=DIMSxDIMS[:dtype][@axis/axis],... e.g. "
                        "images=16x8x8x1:float32,labels=16:int32 (leading dimension = batch; default axes: batch on "
                        "it). Default: the built-in model's batch from --batch-size/--seq-len")
    p.add_argument("--loss", default=None,
                   help="module:function, the loss (model, batch) -> (loss_sum, weight[, metrics]) for estimates "
                        "from the compiled step (default: the built-in model's loss)")
    p.add_argument("--slices", type=int, default=None,
                   help="TPU slices or GPU nodes the devices span (default: the chip's own fast-link domain: 8 GPUs "
                        "per node, a TPU pod): mesh axes spanning more than devices/slices use the slow links (DCN, "
                        "InfiniBand), e.g. --devices 512 --hardware tpu-v5p --slices 2")
    p.add_argument("--top", type=int, default=8, help="with --recipe auto: how many ranked layouts to print")
    p.add_argument("--check", choices=CHECKS, default="none",
                   help="compile: compile here and compare with XLA (≤ 8 devices); lower: lower on an "
                        "AbstractMesh for the target platform; tpu: compile for a fake TPU topology (needs libtpu); "
                        "gpu: compile with XLA:GPU for --topology NxH100|NxH200|NxA100 (needs the gpu-aot extra)")
    p.add_argument("--topology", default=None,
                   help="with --check tpu: fake TPU topology, e.g. v5e:4x4 or v5p:2x2x2 (default: from "
                        "--hardware and --devices); with --check gpu: N GPUs of one kind, 8xH100, 8xH200 or 8xA100 "
                        "(sets --hardware and --devices)")
    # `train --dcn` has no meaning for a plan (no processes): refused with a pointer to --slices, not
    # argparse's bare "unrecognized arguments"
    p.add_argument("--dcn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--generate", action="store_true",
                   help="a built-in decoder: also the generation memory per device (weights as trained, bf16, int8; "
                        "the KV cache of --batch-size rows x --seq-len slots)")
    add_device_args(p)
    p.set_defaults(run=run, setup_devices=False, prepare=prepare)


#: The run configuration's settings that ``plan`` has flags for (generated: the same names, help and defaults
#: as ``meshtrain train``'s, so that a plan describes the run ``train`` starts with the same flags).
PLAN_FLAG_KEYS = ("model.name", "model.rules", "model.lora_rank", "model.lora_alpha", "model.lora_targets",
                  "model.lora_base", "recipe.name", "recipe.mesh", "data.batch_size", "data.seq_len",
                  "monitor.hardware")
LIST_PARAMS_HELP = ("print every parameter's path, shape, dtype and logical names (with --rules: as the rules give "
                    "them), then the model state's (batch statistics, RNG streams), and stop; write path rules "
                    "against these paths")


def prepare(args) -> None:
    """Resolve ``--config``/``--set`` with the flags and put the values where the plan reads them."""
    resolved = resolve(args, PLAN_FLAG_KEYS + ("distributed.devices",), recipe_options=True)
    write_back(args, resolved, PLAN_FLAG_KEYS + ("distributed.devices",))
    args.resolved = resolved   # --hardware not given: this host's chip, once its devices are set up (run)


def given(args, flag: str) -> bool:
    """Whether ``--batch-size`` / ``--seq-len`` (``flag``: ``batch_size``, ``seq_len``) was given (flag, ``--config``
    or ``--set``) rather than left at the run configuration's default, which ``plan`` then fits as ``train``
    does: the batch rounded up to the layout's multiple; no sequence length for an image model."""
    resolved = getattr(args, "resolved", None)
    if resolved is not None:
        return resolved.given_here(f"data.{flag}")
    recorded = getattr(args, "given_flags", None)
    return flag in recorded if recorded is not None else getattr(args, flag, None) is not None


def planned_batch_size(args, multiple: int) -> int:
    """``--batch-size`` when given; else its default (16) rounded up to a multiple of ``multiple`` (the
    data-parallel size × micro-batches; under ``--recipe auto`` the device count, which every candidate's
    divides), as ``meshtrain train`` rounds it (:func:`~meshtrain.train.config.fitted_batch_size`)."""
    if given(args, "batch_size"):
        return args.batch_size
    return fitted_batch_size(data_value(args, "batch_size"), multiple)


def data_value(args, flag: str) -> int:
    """``args.batch_size`` / ``args.seq_len``; the run configuration's default where a namespace built by hand
    lacks it."""
    value = getattr(args, flag, None)
    return value if value is not None else setting_at(f"data.{flag}").default


def list_params_text(choice: "ModelChoice", infos=None) -> str:
    """``--list-params``: one line per parameter, then how many have no logical axes yet, then the model state
    (non-parameter variables: batch statistics, RNG streams), which path rules may name too."""
    infos = infos if infos is not None else list_params_and_state(choice)
    params = [i for i in infos if i.group == "params"]
    state = [i for i in infos if i.group == "model_state"]
    missing = sum(i.names is None for i in params)
    lines = [f"# {len(params)} parameters of --model {choice.name}: path  shape  dtype  (logical names)  [from]"]
    lines += [i.line() for i in params]
    lines.append(f"# {missing} without logical axes" + (": give them path rules (--rules FILE.yaml, paths:)"
                                                         if missing else ""))
    if state:
        lines.append(f"# {len(state)} model state variables (not trained; carried by the step and checkpointed; "
                     f"path rules shard them, else replicated): path  shape  dtype  (logical names)  [from]")
        lines += [i.line() for i in state]
    return "\n".join(lines)


def list_params_and_state(choice: "ModelChoice"):
    """``--list-params``' entries: the parameters, then the model state (``ParamInfo.group``)."""
    return list_params(choice.factory, choice.rules) + list_model_state(choice.factory, choice.rules)


def _apply_options(recipe, args):
    if getattr(args, "mesh", None):
        recipe = recipe.with_mesh(**MeshSpec.parse(args.mesh))
    changes = recipe_overrides(args)
    check_recipe_overrides(recipe, attention=changes.get("attention"), schedule=changes.get("schedule"),
                           repeats=changes.get("repeats"))
    return recipe.with_options(**changes) if changes else recipe


#: Integer flags that count something (``None``: not given); 0 or less means nothing.
_COUNTS = {"batch_size": "the global batch in sequences; omit it for 16, rounded up to the data-parallel size",
           "seq_len": "tokens per sequence; omit it for 128, as meshtrain train does",
           "top": "how many ranked layouts --recipe auto prints",
           "slices": "TPU slices or GPU nodes the devices span; 1 for one"}


def check_flags(args) -> None:
    """Flags that would be silently ignored: ``--topology`` without a compile check, ``--batch`` under
    ``--recipe auto`` (the search plans from ``--batch-size``/``--seq-len``), ``--dcn`` (a run's flag)."""
    if getattr(args, "topology", None) is not None and args.check not in ("tpu", "gpu"):
        raise ConfigError(f"--topology {args.topology} needs --check gpu or --check tpu (it names the devices those "
                          f"checks compile for); add one, or drop --topology and give --hardware and --devices")
    if getattr(args, "batch", None) and args.recipe == "auto":
        raise ConfigError("--batch does not apply with --recipe auto (the search plans a built-in decoder's batch "
                          "from --batch-size and --seq-len); give those instead, or name a recipe")
    if getattr(args, "dcn", None):
        raise ConfigError(f"--dcn {args.dcn}: `meshtrain plan` has no processes to split; plan slow links with "
                          f"--slices N (the devices span N slices/nodes) or a recipe file's mesh dcn: sizes "
                          f"(`meshtrain train --dcn` applies to a run)")


def warn_dcn(plan, args) -> None:
    """A recipe's ``mesh: dcn:`` sizes put axes across slices/nodes: warn when the plan's devices are
    fewer slices/nodes (fast-link domains of ``--hardware`` with ``--slices``) than those sizes need,
    as ``meshtrain train --dcn`` warns in a single process: the estimates then price the axes on slow
    links the planned devices do not have."""
    from meshtrain.analysis.planner import PlanRequest  # lazy: analysis (~50 ms) off the CLI's path

    dcn = {a: s for a, s in plan.recipe.mesh.dcn if s > 1}
    if not dcn:
        return
    n = math.prod(plan.mesh_sizes.values())
    hw = PlanRequest(None, n, getattr(args, "hardware", "cpu") or "cpu", slices=getattr(args, "slices", None) or 1).hw()
    domains = max(1, n // min(hw.fast_domain, n))
    groups = math.prod(dcn.values())
    if groups > domains:
        sizes = ",".join(f"{a}={s}" for a, s in dcn.items())
        warnings.warn(f"recipe {plan.recipe.name!r} puts {sizes} across slices/nodes (mesh dcn:), but the {n} "
                      f"{hw.name} devices planned form {domains} fast-link domain{'s' if domains > 1 else ''}: the "
                      f"estimates price those axes on slow links; pass --slices {groups} (with --devices and "
                      f"--hardware of that many slices/nodes), or drop the recipe's dcn:")


def check_counts(args) -> None:
    """``--batch-size``, ``--seq-len``, ``--top`` and ``--slices`` must be at least 1."""
    for name, meaning in _COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: give a positive integer ({meaning})")


def check_seq_len(choice: "ModelChoice", args) -> None:
    """``--seq-len`` against the built-in model's range: none for images; BERT's learned position
    table has ``max_positions`` rows (an error beyond); a decoder's rotary positions have no table,
    so beyond ``max_seq_len`` (which its forward and ``meshtrain train`` enforce) the plan is a
    long-context what-if (README, notebook 06): a warning, not an error."""
    cfg, T = choice.cfg, args.seq_len
    if T is None or (isinstance(cfg, ViTConfig) and not given(args, "seq_len")):
        return
    if isinstance(cfg, ViTConfig):
        raise ConfigError(f"--seq-len does not apply to {cfg.name} (an image model); use --batch-size, or "
                          f"--batch for other image shapes")
    _check_length(cfg, T, f"--seq-len {T}", f"--seq-len <= {getattr(cfg, 'max_positions', 0)}")


def _check_length(cfg, T: int, what: str, fix: str) -> None:
    """A sequence of ``T`` tokens against a built-in decoder's or BERT's maximum (see :func:`check_seq_len`)."""
    if isinstance(cfg, BertConfig) and T > cfg.max_positions:
        raise ConfigError(f"{what} is longer than model {cfg.name!r} has positions (max_positions "
                          f"{cfg.max_positions}, a learned table); use {fix}")
    if isinstance(cfg, DecoderConfig) and T > cfg.max_seq_len:
        warnings.warn(f"{what} is longer than model {cfg.name!r} supports (max_seq_len {cfg.max_seq_len}): "
                      f"planned as a long-context variant; `meshtrain train` refuses it (a config with a larger "
                      f"max_seq_len trains it)")


def check_batch_seq_len(choice: "ModelChoice", layout: BatchLayout) -> None:
    """The sequence length of a ``--batch`` layout (its ``seq`` dimensions) against a built-in model's
    maximum, as :func:`check_seq_len` checks ``--seq-len``."""
    lengths = {leaf.shape[leaf.seq_dim] for _, leaf in layout.leaves() if leaf.seq_dim is not None}
    if choice.cfg is not None and lengths:
        T = max(lengths)
        _check_length(choice.cfg, T, f"--batch's sequence length {T}",
                      f"a 'seq' dimension <= {getattr(choice.cfg, 'max_positions', 0)}")


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """What ``--model`` / ``--loss`` name: ``cfg`` is a built-in config or ``None`` (a user factory)."""

    name: str
    cfg: Any
    factory: Callable
    loss_fn: Optional[Callable]
    #: ``--rules``: path rules and logical mappings for the model (``None``: none given)
    rules: Optional[ModelRules] = None
    #: LoRA adapters on the model (``--lora-rank``): the estimates come from the traced step, whose
    #: gradients and optimizer state are the adapters' (the analytic formulas assume every weight trains)
    lora: bool = False

    @property
    def analytic(self) -> bool:
        from meshtrain.analysis.compiled import has_analytic_model  # lazy: analysis (~50 ms) off the CLI's path

        return has_analytic_model(self.cfg) and not self.lora


def resolve_model(args) -> ModelChoice:
    """``--model`` (:func:`meshtrain.model_source.model_source`: a name, HF_DIR, RUN or file.py:fn, as
    for ``train``) and ``--loss`` → :class:`ModelChoice` (see the module docstring)."""
    source = model_source(args.model)
    loss = getattr(args, "loss", None)
    if loss:
        loss_fn = load_ref(loss, "--loss")
        check_arity(loss_fn, loss, "--loss", 2, LOSS_CONTRACT)
    else:
        loss_fn = None  # a built-in model's own loss, once the batch is known (analysis.compiled.default_loss)
    lora = TrainConfig(lora_rank=getattr(args, "lora_rank", 0) or 0, lora_alpha=float(getattr(args, "lora_alpha", 16.0)),
                       lora_targets=getattr(args, "lora_targets", "q,k,v,o"),
                       lora_base=getattr(args, "lora_base", "param")).lora_config()
    return ModelChoice(args.model, source.config, lora_factory(source.factory(), lora), loss_fn,
                       ModelRules.load(getattr(args, "rules", None)), lora is not None)


_ENTRY = re.compile(r"^(?P<name>[A-Za-z_][\w/.-]*)=(?P<dims>[0-9]+(?:x[0-9]+)*)(?::(?P<dtype>[A-Za-z0-9_]+))?"
                    r"(?:@(?P<axes>[A-Za-z_\-][\w\-]*(?:/[A-Za-z_\-][\w\-]*)*))?$")


def parse_batch(text: str):
    """``--batch`` text → ``(example pytree of ShapeDtypeStructs, axes per leaf)`` (module docstring)."""
    import jax
    import jax.numpy as jnp

    example: Dict[str, Any] = {}
    axes: Dict[str, Any] = {}
    fmt = ("--batch takes comma-separated name=DIMS[:dtype][@axes] entries, e.g. "
           "images=16x8x8x1:float32,labels=16:int32 or input_ids=8x128:int32@batch/seq")
    entries = [e.strip() for e in (text or "").split(",")]
    if not any(entries):
        raise ConfigError(f"--batch is empty; {fmt}")
    for entry in entries:
        m = _ENTRY.match(entry)
        if not m:
            raise ConfigError(f"--batch entry {entry!r} is malformed; {fmt}")
        dims = tuple(int(d) for d in m.group("dims").split("x"))
        if any(d < 1 for d in dims):
            raise ConfigError(f"--batch entry {entry!r}: every dimension must be positive")
        try:
            dtype = jnp.dtype(m.group("dtype") or "float32")
        except TypeError:
            raise ConfigError(f"--batch entry {entry!r}: unknown dtype {m.group('dtype')!r} (use e.g. float32, "
                              f"bfloat16, int32, bool)") from None
        names = None
        if m.group("axes"):
            names = tuple(None if a in ("-", "none", "None") else a for a in m.group("axes").split("/"))
            if len(names) != len(dims):
                raise ConfigError(f"--batch entry {entry!r}: {len(names)} axis names for {len(dims)} dimensions; "
                                  f"give one per dimension ('-' for none)")
        path = m.group("name").split("/")
        node, anode = example, axes
        for key in path[:-1]:
            node = node.setdefault(key, {})
            anode = anode.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--batch entry {entry!r}: {key!r} is both a leaf and a group")
        if path[-1] in node:
            raise ConfigError(f"--batch names {m.group('name')!r} twice")
        node[path[-1]] = jax.ShapeDtypeStruct(dims, dtype)
        if names is not None:
            anode[path[-1]] = names
    return example, _prune(axes)


def _prune(tree):
    if isinstance(tree, dict):
        out = {k: _prune(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v != {}}
    return tree


def default_batch(choice: ModelChoice, args, dp: int):
    """The built-in model's batch (``BatchSpec`` or ``BatchLayout``) with ``--batch-size``/``--seq-len``."""
    import jax
    import jax.numpy as jnp

    cfg = choice.cfg
    B = planned_batch_size(args, dp)
    check_seq_len(choice, args)
    if isinstance(cfg, ViTConfig):
        return BatchLayout.from_example({
            "images": jax.ShapeDtypeStruct((B, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32),
            "labels": jax.ShapeDtypeStruct((B,), jnp.int32)})
    if isinstance(cfg, BertConfig):
        return BatchSpec(B, data_value(args, "seq_len"), keys=tuple(KEYS)).layout()
    if cfg is None:
        raise ConfigError(f"--model {choice.name} is a user model: describe its batch with --batch, e.g. "
                          f"--batch images=16x8x8x1:float32,labels=16:int32 (leading dimension = batch)")
    return BatchSpec(B, data_value(args, "seq_len"))


def _batch_layout(choice: ModelChoice, args, dp: int):
    if not getattr(args, "batch", None):
        return default_batch(choice, args, dp)
    if given(args, "seq_len"):
        raise ConfigError("--seq-len does not apply with --batch; give the sequence length in the shapes")
    example, axes = parse_batch(args.batch)
    layout = BatchLayout.from_example(example, axes or None)
    check_batch_seq_len(choice, layout)
    sizes = {p: leaf.shape[leaf.batch_dim] for p, leaf in layout.leaves() if leaf.batch_dim is not None}
    if given(args, "batch_size") and any(v != args.batch_size for v in sizes.values()):
        raise ConfigError(f"--batch-size {args.batch_size} disagrees with --batch (batch dimensions {sizes}); "
                          f"drop --batch-size or change the shapes")
    return layout


def build(args, choice: Optional[ModelChoice] = None):
    """``(plan, choice)``: recipe + mesh + abstract model + batch → ``ShardingPlan``.

    More devices than exist (``--devices`` beyond this machine) → the plan lives on an AbstractMesh.
    """
    import jax

    choice = choice or resolve_model(args)
    recipe = _apply_options(get_recipe(args.recipe), args)
    hardware = getattr(args, "hardware", "cpu") or "cpu"
    if hardware != "cpu" and getattr(args, "compute_dtype", None) is None:
        recipe = recipe.with_options(compute_dtype="bfloat16")  # accelerator peaks are bf16 figures
    n = args.devices or len(jax.devices())
    if n <= len(jax.devices()):
        mesh = recipe.mesh.build(jax.devices()[:n])
    else:  # more devices than this machine has (an accelerator host asked for a pod): plan abstractly
        mesh = recipe.mesh.abstract(n)
    try:
        # train's optimizer (AdamW after global-norm clipping; onebit: 1-bit Adam's): the same optimizer-state
        # paths as its plan.json
        factory = grad_compression.feedback_factory(fp8.recipe_factory(choice.factory, recipe), recipe)
        variance = AdamVariance.FREEZES if grad_compression.resolve(recipe).has_feedback else AdamVariance.LEARNT
        abstract = abstract_state(factory, default_optimizer(TrainConfig(), {}, variance),
                                  annotations=choice.rules)
    except MeshtrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory: say what calling it did
        raise ConfigError(f"--model {choice.name}: calling it with rngs failed: {type(exc).__name__}: {exc}; "
                          f"{FACTORY_CONTRACT}") from None
    probe = make_plan(abstract, recipe, mesh, check=False)
    dp = probe.data_parallel_size * batch_splits(recipe)
    batch = _batch_layout(choice, args, dp)
    for T in _seq_lengths(batch):  # before the batch is resolved: name --seq-len, not a leaf's dimension
        check_context_seq_len(probe.recipe, probe.rules, probe.mesh_sizes, T)
    return make_plan(abstract, recipe, mesh, batch=batch), choice


def _seq_lengths(batch) -> set:
    if isinstance(batch, BatchSpec):
        return {batch.seq_len}
    return {leaf.shape[leaf.seq_dim] for _, leaf in batch.leaves() if leaf.seq_dim is not None}


def build_plan(args):
    """Recipe + mesh + abstract model → ``ShardingPlan`` (shared with the planner); see :func:`build`."""
    return build(args)[0]


def _setup(args) -> None:
    n = args.devices
    if n is not None and n < 1:
        setup_devices(n)  # raises the usual error
    if n is None or n <= LOCAL_SIMULATION_LIMIT or "JAX_NUM_CPU_DEVICES" in os.environ:
        setup_devices(n)
    else:
        setup_devices(None)  # keep the default simulated devices; the plan itself is abstract


def _recipe_line(recipe) -> str:
    """``recipe NAME: dp + fsdp + cp(load_balance=none, flash_backend=xla) (remat full)``: every dimension
    with the options it sets, and the knobs that differ from their defaults."""
    return f"recipe {recipe.name}: {' + '.join(str(s) for s in recipe.strategies)}{recipe.knobs_text()}"


def _gpu_target(args) -> None:
    """``--check gpu``: ``--topology NxCHIP`` (default: ``--hardware`` × ``--devices``) sets the chip the
    estimates are for and the device count; the plugin must be installed (checked before any work)."""
    hardware = None if args.hardware == "cpu" else args.hardware
    if args.topology is None:
        if hardware not in gpu_aot.ARCHS:
            raise ConfigError(f"--check gpu needs --topology ({gpu_aot.topology_choices()}, e.g. 8xH100) or a GPU "
                              f"--hardware ({', '.join(sorted(gpu_aot.ARCHS))})")
        args.topology = f"{args.devices or gpu_aot.GPUS_PER_HOST}x{hardware.upper()}"
    topology = gpu_aot.parse_topology(args.topology)
    if hardware is not None and hardware != topology.hardware:
        raise ConfigError(f"--hardware {args.hardware} disagrees with --topology {args.topology}; drop --hardware "
                          f"(the topology sets it)")
    if args.devices is not None and args.devices != topology.count:
        raise ConfigError(f"--devices {args.devices} disagrees with --topology {args.topology} ({topology.count} "
                          f"GPUs); drop --devices (the topology sets it)")
    if not gpu_aot.available():
        raise gpu_aot.missing_plugin_error()
    args.hardware, args.devices = topology.hardware, topology.count
    gpu_aot.prefer_cpu_backend()


def run(args) -> int:
    from meshtrain.analysis import report  # lazy: analysis (~50 ms) off the CLI's path
    from meshtrain.analysis.forecast import with_forecast  # lazy: analysis (~50 ms) off the CLI's path

    check_counts(args)
    check_flags(args)
    if args.check == "gpu":
        _gpu_target(args)
    _setup(args)
    import jax   # after _setup: the device count is set before JAX starts its backend

    if args.hardware is None:   # train's default: this host's chip (cpu where the device kind has no profile)
        args.hardware = hardware_of(jax.devices()[0]) or "cpu"
    choice = resolve_model(args)
    if getattr(args, "list_params", False):
        try:
            infos = list_params_and_state(choice)
        except MeshtrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's factory: say what calling it did
            raise ConfigError(f"--model {choice.name}: calling it with rngs failed: {type(exc).__name__}: {exc}; "
                              f"{FACTORY_CONTRACT}") from None
        print(json.dumps([dataclasses.asdict(i) for i in infos]) if args.json else list_params_text(choice, infos))
        return 0
    if args.recipe == "auto":
        check_seq_len(choice, args)
        args.batch_size = planned_batch_size(args, args.devices or len(jax.devices()))
        result = report.auto(args, choice.cfg)
        out = report.auto_dict(result, args) if args.json else report.auto_text(result, args)
        out = with_forecast(out, result.winner.plan, choice.cfg, args)
    else:
        plan, _ = build(args, choice)
        warn_dcn(plan, args)
        extra = {} if choice.analytic else {"loss_fn": choice.loss_fn, "model_name": choice.name}
        cfg = choice.cfg
        if choice.lora:  # the traced step of the model with adapters, with the decoder's own loss
            from meshtrain.analysis.compiled import default_loss  # lazy: analysis (~50 ms) off the CLI's path

            cfg, extra["loss_fn"] = None, choice.loss_fn or default_loss(choice.cfg, plan)
        try:
            out = (report.single_dict(plan, cfg, args, **extra) if args.json
                   else report.single_text(plan, cfg, args, **extra) + "\n" + _recipe_line(plan.recipe))
        except MeshtrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - user code (model or loss) failed while the step was traced
            if choice.cfg is not None and not args.loss:
                raise
            raise ConfigError(f"tracing the train step of --model {choice.name}"
                              + (f" with --loss {args.loss}" if args.loss else "")
                              + f" on the --batch layout failed: {type(exc).__name__}: {exc}; check that the loss "
                                f"reads the batch's keys and returns (loss_sum, weight[, metrics])") from None
        out = with_forecast(out, plan, choice.cfg, args)
    if args.generate and args.recipe != "auto":
        out = _with_generation(out, plan, choice, args)
    print(json.dumps(out, default=str) if args.json else out)
    return 0


def _with_generation(out, plan, choice, args):
    """``--generate``: the report with the generation figures (:mod:`meshtrain.generation.memory`)."""
    from meshtrain.generation.memory import generation_bytes  # lazy: off the CLI's path

    if not isinstance(choice.cfg, DecoderConfig):
        raise ConfigError(f"--generate needs a built-in decoder (tiny, small, llama3-8b, ...), not {choice.name!r}")
    g = generation_bytes(choice.cfg, plan, plan.batch.batch_size, plan.batch.seq_len)
    if args.json:
        return {**out, "generation": g}
    return out + (f"\ngeneration ({g['batch']} rows x {g['seq']} slots), per device: weights "
                  f"{fmt_bytes(g['weights_none'])} as trained, {fmt_bytes(g['weights_bf16'])} bf16, "
                  f"{fmt_bytes(g['weights_int8'])} int8; KV cache {fmt_bytes(g['kv_cache'])} "
                  f"({plan.recipe.compute_dtype}), {fmt_bytes(g['kv_cache_bf16'])} bf16; with --offload-weights "
                  f"(one layer on the device, the stack in host memory): {fmt_bytes(g['weights_none_offloaded'])} / "
                  f"{fmt_bytes(g['weights_bf16_offloaded'])} / {fmt_bytes(g['weights_int8_offloaded'])} on the "
                  f"device, {fmt_bytes(g['host_weights_none'])} / {fmt_bytes(g['host_weights_bf16'])} / "
                  f"{fmt_bytes(g['host_weights_int8'])} in host memory")
