"""One decision per step (:func:`meshtrain.parallel.resolved.resolve_step`): each kernel choice is made in one
function, and the plan's kernel line, the memory terms' kernel assumption and the compiled step agree for every
built-in recipe × attention kind × target (XLA:CPU compiled here; XLA:TPU and XLA:GPU compile-only where their
extras are installed)."""

import importlib.util
import os
import re

import pytest

import meshtrain as mt
from meshtrain.analysis import gpu_aot
from meshtrain.analysis.hardware import get_hardware
from meshtrain.analysis.memory_terms import step_shape
from meshtrain.analysis.report import kernel_line
from meshtrain.models import get_config, model_factory
from meshtrain.parallel.resolved import Target, resolve_step
from meshtrain.recipes import BUILTIN_RECIPES, AttentionKind, LayerLoop, Schedule
from meshtrain.strategies import Context, FlashBackend
from meshtrain.train.config import TrainConfig, default_optimizer

PACKAGE = os.path.dirname(os.path.abspath(mt.__file__))
RESOLVER = os.path.join("parallel", "resolved.py")


def _sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


#: A kernel decision, as it reads in source: where it may appear (the resolver; the flash kernel may validate a
#: backend handed to it outside a step through the resolver's one function).
DECISIONS = {
    "the cp dimension's backend default": (r"flash_backend if .* else FlashBackend\.AUTO", {RESOLVER}),
    "a test of FlashBackend.AUTO": (r"(\bis|is not|==|!=)\s+FlashBackend\.AUTO|FlashBackend\.AUTO\s+(is|==|!=)",
                                    {RESOLVER}),
    "cuDNN's packed-documents capability check": (r"[<>]=?\s*(\w+\.)?PACKED_MIN_CAPABILITY", {RESOLVER}),
    "a backend returned as a decision": (r"return FlashBackend\.(CUDNN|SPLASH|XLA)\b", {RESOLVER}),
    "the eligibility function called": (r"\bflash_backend\(", {RESOLVER, os.path.join("parallel", "flash.py")}),
    "the old re-derivations": (r"def (runs_splash|runs_cudnn)\b", set()),
    "the derived recipe fields read": (r"recipe\.(attention|micro_batches|schedule|repeats)\b", set()),
}


@pytest.mark.parametrize("what", list(DECISIONS))
def test_each_kernel_choice_is_made_in_one_function(what):
    pattern, allowed = DECISIONS[what]
    found = {path for path, text in _sources() if re.search(pattern, text)}
    assert found <= allowed, f"{what} outside {sorted(allowed) or 'any module'}: {sorted(found - allowed)}"
    if allowed:
        assert RESOLVER in found  # the pattern still describes the resolver's code


# -- the plan, the memory terms and the step agree ---------------------------------------------------------------

#: (hardware profile, the target it compiles for)
TARGETS = {"cpu": Target("cpu"), "h100": Target("gpu", (9, 0)), "a100": Target("gpu", (8, 0)),
           "tpu-v5p": Target("tpu")}


def _kinds(recipe):
    if recipe.dimension(Context) is None:
        return [{"local_attention": "dense"}, {"local_attention": "flash"}]
    if recipe.dimension(Context).kind.value == "usp":  # usp's `ulysses` axis is claimed by that kind only
        return [{"context_kind": "usp"}]
    return [{"context_kind": k} for k in ("all_gather", "ring", "ulysses")]


CASES = [(name, opts) for name, r in BUILTIN_RECIPES.items() for opts in _kinds(r)]


@pytest.fixture(scope="module")
def tiny_abstract():
    cfg = get_config("tiny", n_layers=2, n_heads=8, n_kv_heads=8, head_dim=8, max_seq_len=64)
    return cfg, mt.abstract_state(model_factory(cfg), default_optimizer(TrainConfig(), {}))


def _expected(kind, runs_kind, target: Target):
    """What the kernels run, written out independently of the resolver (packed documents, bf16)."""
    if kind is AttentionKind.DENSE:
        return None
    if runs_kind in (AttentionKind.RING, AttentionKind.ALL_GATHER, AttentionKind.USP, AttentionKind.ULYSSES):
        return FlashBackend.XLA  # ring-like kernels: blockwise XLA; ulysses: auto keeps blockwise XLA locally
    if kind is not AttentionKind.FLASH:
        return FlashBackend.XLA  # a context kind over size-1 axes: the whole sequence on each device
    if target.platform == "tpu":
        return FlashBackend.SPLASH
    if target.gpu and target.compute_capability >= (9, 0):
        return FlashBackend.CUDNN
    return FlashBackend.XLA


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{list(o.values())[0]}" for n, o in CASES])
def test_the_kernel_line_and_the_memory_terms_read_the_one_decision(tiny_abstract, name, options):
    cfg, abstract = tiny_abstract
    recipe = mt.get_recipe(name).with_options(compute_dtype="bfloat16", **options)
    plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(16, 64))
    for hardware, target in TARGETS.items():
        hw = get_hardware(hardware, num_devices=8)
        step = resolve_step(plan, gpu_aot.hardware_target(hw))
        assert step.target == target
        kind = AttentionKind(options.get("context_kind") or options["local_attention"])
        assert step.attention.kind is kind
        assert step.attention.backend is _expected(kind, step.attention.layout.kind, target), hardware
        line = kernel_line(plan, hw)
        assert line.startswith(f"attention kernel for {target.name}: ")
        named = {b for b in FlashBackend if re.search(rf": {b.value}\b", line)}
        assert named == ({step.attention.backend} if step.attention.backend and not step.attention.layout.sharded
                         or step.attention.layout.kind is AttentionKind.ULYSSES else set()), line
        shape = step_shape(plan, cfg, gpu_aot.hardware_target(hw))
        assert shape.resolved == step
        narrow_gpu = target.gpu and shape.pipe is None and shape.moe is None
        assert shape.cudnn is (narrow_gpu and step.attention.backend is FlashBackend.CUDNN)
        assert (shape.attention_blocks == 0) is (shape.cudnn or kind is AttentionKind.DENSE)


def test_the_step_splits_and_loops_as_resolved(tiny_abstract):
    _, abstract = tiny_abstract
    pp = mt.get_recipe("pp").with_options(schedule="1f1b", pipeline_micro_batches=4)
    step = resolve_step(mt.make_plan(abstract, pp, batch=mt.BatchSpec(16, 64)), "cpu")
    assert (step.schedule, step.pipeline_micro_batches, step.grad_accum, step.batch_splits) == (
        Schedule.ONE_F_ONE_B, 4, 1, 4)
    dp = mt.get_recipe("dp").with_options(grad_accum=2, remat="full", param_dtype="float32")
    step = resolve_step(mt.make_plan(abstract, dp, batch=mt.BatchSpec(16, 64)), "cpu")
    assert (step.schedule, step.grad_accum, step.batch_splits, step.param_dtype) == (None, 2, 2, "float32")
    assert step.loop_for(2) == (LayerLoop.SCAN, 1) and step.for_generation().loop_for(2) == (LayerLoop.UNROLLED, 2)


#: One recipe per kernel family, compiled for XLA:CPU: (recipe, options, collectives its kernel must emit); all_gather
#: runs the blockwise kernel ring and usp run, with no collective of its own to tell it from FSDP's gathers
CPU_CASES = [("dp", {"local_attention": "dense"}, ()), ("dp", {"local_attention": "flash"}, ()),
             ("cp", {}, ("collective-permute",)), ("fsdp_cp", {"context_kind": "ulysses"}, ("all-to-all",)),
             ("fsdp_cp_usp", {}, ("all-to-all", "collective-permute"))]


@pytest.mark.parametrize("name, options, collectives", CPU_CASES)
def test_the_compiled_cpu_step_runs_the_resolved_kernel(name, options, collectives):
    from meshtrain.analysis.compiled import compile_step

    cfg = get_config("tiny", n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16, max_seq_len=64)
    abstract = mt.abstract_state(model_factory(cfg), default_optimizer(TrainConfig(), {}))
    plan = mt.make_plan(abstract, mt.get_recipe(name).with_options(**options), batch=mt.BatchSpec(8, 64))
    step = resolve_step(plan)
    assert step.target == Target("cpu") and "attention kernel for cpu: " in kernel_line(plan, get_hardware("cpu"))
    text = compile_step(plan).as_text()
    assert not re.findall(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[^"]*)"', text)  # plain dots
    # the blockwise kernel skips hidden blocks with a conditional; dense attention has none
    assert ("conditional(" in text) is (step.attention.backend is FlashBackend.XLA), step.attention.describe()
    for op in collectives:
        assert op in text, (op, step.attention.describe())
    assert ("collective-permute" in text) is (step.attention.layout.kind in (AttentionKind.RING, AttentionKind.USP)
                                              and step.attention.layout.ring > 1)


def _big_head_abstract():
    cfg = get_config("tiny", max_seq_len=1024, d_model=256, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=512)
    return cfg, mt.abstract_state(model_factory(cfg), default_optimizer(TrainConfig(), {}))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'meshtrain[tpu]')")
@pytest.mark.parametrize("name, options", [("fsdp", {"local_attention": "dense"}), ("fsdp", {"local_attention": "flash"}),
                                           ("fsdp_cp", {"context_kind": "ulysses"}),
                                           ("fsdp_cp", {"flash_backend": "splash", "context_kind": "ulysses"})])
def test_the_compiled_tpu_step_runs_the_resolved_kernel(name, options):
    from meshtrain.analysis.lowering import compile_tpu_topology

    cfg, abstract = _big_head_abstract()
    recipe = mt.get_recipe(name).with_options(compute_dtype="bfloat16", **options)
    plan, compiled = compile_tpu_topology(abstract, recipe, mt.BatchSpec(8, 1024), "v5p:2x2x2")
    step = resolve_step(plan)
    assert step.target.platform == "tpu"
    splash = len(re.findall(r'custom_call_target="tpu_custom_call"', compiled.as_text()))
    assert (splash >= 2 * cfg.n_layers) is (step.attention.backend is FlashBackend.SPLASH)
    assert ("splash" in kernel_line(plan, get_hardware("tpu-v5p", num_devices=8))) is (splash > 0)


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the XLA:GPU plugin (pip install 'meshtrain[gpu-aot]')")
@pytest.mark.parametrize("name, options", [("fsdp", {"local_attention": "dense"}), ("fsdp", {"local_attention": "flash"}),
                                           ("fsdp_cp", {"context_kind": "ring"})])
@pytest.mark.parametrize("topology", ["8xH100", "8xA100"])
def test_the_compiled_gpu_step_runs_the_resolved_kernel(name, options, topology):
    cfg, abstract = _big_head_abstract()
    recipe = mt.get_recipe(name).with_options(compute_dtype="bfloat16", **options)
    plan, compiled = gpu_aot.compile_gpu_topology(abstract, recipe, mt.BatchSpec(8, 1024),
                                                  gpu_aot.parse_topology(topology))
    hw = get_hardware(topology[2:].lower(), num_devices=8)
    step = resolve_step(plan)
    assert step == resolve_step(plan, gpu_aot.hardware_target(hw))  # the devices' target is the profile's
    calls = gpu_aot.cudnn_attention_calls(compiled.as_text())
    assert (calls["forward"] == cfg.n_layers) is (step.attention.backend is FlashBackend.CUDNN)
    assert ("cudnn" in kernel_line(plan, hw)) is (calls["forward"] > 0)
    assert step_shape(plan, cfg, gpu_aot.hardware_target(hw)).cudnn is (calls["forward"] > 0)


# -- old names: read in one place, with a deprecation naming the new spelling ------------------------------------

@pytest.mark.parametrize("recipe, old, new", [
    ("dp", {"micro_batches": 4}, {"grad_accum": 4}),
    ("pp", {"micro_batches": 4}, {"pipeline_micro_batches": 4}),
    ("fsdp", {"attention": "flash"}, {"local_attention": "flash"}),
    ("fsdp_cp", {"attention": "ulysses"}, {"context_kind": "ulysses"}),
])
def test_old_option_names_are_translated_with_a_deprecation(recipe, old, new):
    base = mt.get_recipe(recipe)
    with pytest.warns(DeprecationWarning, match=rf"recipe option '{list(old)[0]}' is deprecated; for recipe "
                                                 rf"'{recipe}' it is '{list(new)[0]}'"):
        got = base.with_options(**old)
    assert got == base.with_options(**new)


def test_old_recipe_file_keys_are_translated_with_a_deprecation(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("name: old\nstrategies: [dp, pp]\nmesh: {ici: {stage: 2, data: -1}}\nmicro_batches: 4\n"
                    "schedule: 1f1b\n")
    with pytest.warns(DeprecationWarning) as seen:
        recipe = mt.get_recipe(str(path))
    assert sorted(str(w.message).split(": recipe option ")[1].split(" ")[0] for w in seen) == ["'micro_batches'",
                                                                                                "'schedule'"]
    pipeline = recipe.dimension(mt.Pipeline)
    assert (pipeline.micro_batches, pipeline.schedule, recipe.grad_accum) == (4, Schedule.ONE_F_ONE_B, 1)
    path.write_text("name: old\nstrategies: [fsdp, cp]\nmesh: {ici: {fsdp: 2, context: -1}}\nattention: dense\n")
    with pytest.raises(mt.errors.RecipeError, match=r"attention='dense': recipe 'old' shards the sequence \(cp\), "
                                                    r"so its attention is cp's kind"):
        mt.get_recipe(str(path))


def test_old_names_are_read_by_one_function():
    found = {path for path, text in _sources() if re.search(r"== \"micro_batches\"|LEGACY_NAMES\[", text)}
    assert found == {"recipes.py"}
    assert not any(hasattr(mt.get_recipe(name), "micro_batches") for name in ("dp", "pp"))
