"""One run configuration for every command (issue 34): ``--config FILE.yaml`` and ``--set section.key=value``
in plan, train, generate and launch, the same flag with the same default everywhere, ``config show``
round-tripping, typed errors naming the dotted key, the supervisor handing its children a typed
configuration, a run's recorded config.yaml reproducing it, and no command module importing meshtrain.cli."""

from __future__ import annotations

import ast
import json
import os
import pathlib

import pytest
import yaml

from meshtrain.cli import build_parser, main
from meshtrain.commands import generate, launch, plan, train
from meshtrain.commands.run_flags import resolve, resolved_of, train_keys
from meshtrain.errors import ConfigError
from meshtrain.train.run_config import CONFIG_FILE, RunConfig, all_keys, setting_at

ROOT = pathlib.Path(__file__).resolve().parent.parent

RUN_YAML = """
model: {name: tiny}
data: {batch_size: 8, seq_len: 32}
recipe: {name: fsdp_tp, options: {remat: full}}
optimizer: {lr: 1.0e-3}
generation: {temperature: 0.5, max_new_tokens: 3}
"""
SETS = ["--set", "optimizer.warmup_steps=5", "--set", "generation.top_k=7"]


def resolved(argv):
    """The resolved configuration of one command line, as that command reads it."""
    args = build_parser().parse_args(argv)
    if argv[0] == "plan":
        plan.prepare(args)
        return args.resolved
    if argv[0] == "generate":
        return resolved_of(args, generate.GENERATE_KEYS)
    if argv[0] == "launch":
        return launch.parse_train(launch.with_config_args(args, launch._command(args)))
    return resolve(args, train_keys(), recipe_options=True)


@pytest.fixture
def run_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RUN_YAML)
    return str(path)


COMMANDS = {
    "plan": ["plan"],
    "train": ["train"],
    "generate": ["generate", "RUN", "--prompt", "x"],
    "serve": ["serve", "RUN"],
    "launch": ["launch", "--processes", "2", "--", "train"],
    "config show": ["config", "show"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_reads_the_same_config_file_and_set_overrides(command, run_yaml):
    argv = COMMANDS[command]
    extra = ["--config", run_yaml, *SETS]
    argv = argv[:3] + extra + argv[3:] if command == "launch" else argv + extra
    cfg = resolved(argv).config
    want = RunConfig().with_values({"model.name": "tiny", "data.batch_size": 8, "data.seq_len": 32,
                                    "recipe.name": "fsdp_tp", "recipe.options.remat": "full", "optimizer.lr": 1e-3,
                                    "generation.temperature": 0.5, "generation.max_new_tokens": 3,
                                    "optimizer.warmup_steps": 5, "generation.top_k": 7})
    assert cfg == want, cfg.differences(want)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_flags_resolve_to_the_one_set_of_defaults(command):
    """Every command's defaults are the RunConfig's: `plan --model` is `small`, as in train."""
    assert resolved(COMMANDS[command]).config == RunConfig()
    args = build_parser().parse_args(["plan"])
    plan.prepare(args)
    assert (args.model, args.recipe, args.mesh) == ("small", "fsdp", None)


@pytest.mark.parametrize("recipe", ["fsdp", "pp_fsdp"])
def test_plan_plans_the_batch_train_runs_with_the_same_flags(recipe):
    """No --batch-size/--seq-len: plan's batch is train's, 16 x 128 rounded up as train rounds it (pp_fsdp on 8
    devices with 8 micro-batches: a multiple of the data-parallel size 4 x 8)."""
    from meshtrain.train.trainer import Trainer

    argv = ["--model", "tiny", "--recipe", recipe] + (["--pipeline-micro-batches", "8"] if recipe == "pp_fsdp" else [])
    args = build_parser().parse_args(["plan", *argv])
    plan.prepare(args)
    planned = plan.build_plan(args).batch
    multiple = Trainer(resolved(["train", *argv]).config.train_config()).batch_multiple()
    assert (planned.batch_size, planned.seq_len) == (-(-16 // multiple) * multiple, 128)
    assert recipe == "fsdp" or planned.batch_size > 16   # the pipeline's multiple is past 16: it rounded


#: (flag, value, dotted key, typed value): flags that plan, train and config show share.
SHARED = [("--model", "vit-tiny", "model.name", "vit-tiny"), ("--recipe", "fsdp_tp", "recipe.name", "fsdp_tp"),
          ("--mesh", "fsdp=2,tensor=4", "recipe.mesh", "fsdp=2,tensor=4"), ("--rules", "r.yaml", "model.rules", "r.yaml"),
          ("--remat", "full", "recipe.options.remat", "full"), ("--devices", "4", "distributed.devices", 4),
          ("--grad-accum", "2", "recipe.options.grad_accum", 2), ("--batch-size", "32", "data.batch_size", 32),
          ("--seq-len", "64", "data.seq_len", 64), ("--hardware", "h100", "monitor.hardware", "h100")]


@pytest.mark.parametrize("command", ["plan", "train", "config show"])
@pytest.mark.parametrize("flag, value, key, typed", SHARED)
def test_a_shared_flag_sets_the_same_key_everywhere(command, flag, value, key, typed):
    got = resolved(COMMANDS[command] + [flag, value])
    assert got.config.differences(RunConfig()) == {key: (typed, RunConfig().values()[key])}
    assert got.given == {key}


def _options(argv_prefix):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    cur = sub[argv_prefix[0]]
    if argv_prefix[0] == "config":
        cur = next(a for a in cur._actions if a.dest == "config_action").choices["show"]
    return {s: a for a in cur._actions for s in a.option_strings}


def test_generated_flags_have_one_help_text():
    """A flag in plan, train, generate and config show is one definition: the same help everywhere,
    but for plan's hidden --dcn (refused: a plan has no processes) and generate's --recipe/--mesh/--seed (the
    generation section's: the run's recipe, the sampling seed)."""
    own = {("plan", "--dcn"), ("generate", "--recipe"),
           ("generate", "--mesh"), ("generate", "--seed"), ("serve", "--recipe"), ("serve", "--mesh")}
    by_command = {c: _options(argv) for c, argv in COMMANDS.items() if c != "launch"}
    shared = 0
    settings = {"--" + setting_at(k).flag.replace("_", "-") for k in all_keys()}
    for flag in settings | {"--config", "--set", "--devices", "--peak-tflops", "--attention", "--micro-batches"}:
        helps = {c: opts[flag].help for c, opts in by_command.items() if flag in opts and (c, flag) not in own}
        if len(helps) > 1:
            shared += 1
            assert len(set(helps.values())) == 1, (flag, helps)
    assert shared > 20


def test_config_show_round_trips(run_yaml, tmp_path, capsys):
    assert main(["config", "show", "--config", run_yaml, *SETS, "--steps", "7", "--sequence-parallel", "on"]) == 0
    first = capsys.readouterr().out
    again = tmp_path / "again.yaml"
    again.write_text(first)
    assert main(["config", "show", "--config", str(again)]) == 0
    assert capsys.readouterr().out == first
    cfg = RunConfig.from_yaml_file(str(again))
    assert cfg.loop.steps == 7 and cfg.recipe.options.sequence_parallel is True and cfg.optimizer.warmup_steps == 5
    assert set(RunConfig().values()) == set(all_keys()) and yaml.safe_load(first)["recipe"]["options"] == {
        "remat": "full", "sequence_parallel": True}


@pytest.mark.parametrize("argv, message", [
    (["--set", "optimizer.lrr=1"], "unknown setting 'optimizer.lrr'; optimizer has: b1, b2, clip_norm, lr,"),
    (["--set", "optimiser.lr=1"], "unknown setting 'optimiser.lr': give section.key with a section among model,"),
    (["--set", "loop.steps=ten"], "loop.steps='ten': use an integer >= 1"),
    (["--set", "loop.steps=0"], "loop.steps=0: use an integer >= 1"),
    (["--set", "optimizer.lr=fast"], "optimizer.lr='fast': use a number"),
    (["--set", "recipe.options.remat=most"], "recipe.options.remat='most': use one of ['none', 'full', 'dots'"),
    (["--set", "checkpoint.resume=maybe"], "checkpoint.resume='maybe': use one of ['no', 'latest']"),
    (["--set", "recipe.options.sequence_parallel=2"], "recipe.options.sequence_parallel='2': use true or false"),
    (["--set", "optimizer.lr"], "--set 'optimizer.lr': give section.key=value"),
    (["--config", "FILE:sections: 3"], "unknown section 'sections'; sections: model, data, recipe,"),
    (["--config", "FILE:loop: [1]"], "section 'loop' must be a mapping of settings"),
    (["--config", "FILE:loop: {stepz: 3}"], "unknown setting 'loop.stepz'; loop has: eval_batches,"),
    (["--config", "FILE:recipe: {options: {remat: most}}"], "recipe.options.remat='most': use one of"),
    (["--config", "FILE:loop: {steps: [}"], "not valid YAML"),
    (["--config", "FILE:model: {name: 5}"], "model.name=5: use a string, e.g. 'small'"),
    (["--config", "/nonexistent/run.yaml"], "--config '/nonexistent/run.yaml': cannot read it"),
])
@pytest.mark.parametrize("command", ["config show", "train", "plan"])
def test_bad_keys_and_values_are_one_line_naming_the_key(command, argv, message, tmp_path, capsys):
    if argv[0] == "--config" and argv[1].startswith("FILE:"):
        path = tmp_path / "bad.yaml"
        path.write_text(argv[1][5:])
        argv = ["--config", str(path)]
    assert main(COMMANDS[command] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_the_supervisor_hands_its_children_a_typed_config(tmp_path, monkeypatch, capsys):
    """--elastic --max-restarts: attempt 1 runs on fewer processes with grad_accum scaled and resume latest,
    given to the children as `train --config <run>/launch/attempt-1.yaml`; the child reads that file."""
    out = tmp_path / "job"
    children = []

    def attempt(args, cmd, port, k=None, processes=None, guard=None):
        children.append((cmd, processes))
        return (137, 1, False) if k == 0 else (0, None, False)

    monkeypatch.setattr(launch, "_attempt", attempt)
    monkeypatch.setattr(launch, "Guard", lambda: type("G", (), {"note": lambda self, text: None,
                                                                "close": lambda self: None})())
    code = main(["launch", "--processes", "2", "--max-restarts", "1", "--elastic", "--restart-backoff", "0",
                 "--set", "optimizer.lr=1e-4", "--", "train", "--model", "tiny", "--batch-size", "8",
                 "--ckpt-every", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert [(c[:2], n) for c, n in children] == [(["train", "--config"], 2), (["train", "--config"], 1)]
    first, second = (resolved(["train", *c[1:]]).config for c, _ in children)
    assert children[1][0][2] == str(out / "launch" / "attempt-1.yaml")
    assert first.differences(second) == {"checkpoint.resume": ("no", "latest"),
                                         "recipe.options.grad_accum": (None, 2)}
    assert (second.model.name, second.data.batch_size, second.optimizer.lr, second.checkpoint.out) == \
        ("tiny", 8, 1e-4, str(out))
    assert first == RunConfig().with_values({"model.name": "tiny", "data.batch_size": 8, "checkpoint.ckpt_every": 1,
                                             "checkpoint.out": str(out), "optimizer.lr": 1e-4})
    events = [json.loads(line) for line in open(out / "events.jsonl")]
    assert [(e["event"], e.get("processes")) for e in events] == [("attempt", 2), ("failed", None), ("restart", None),
                                                                   ("attempt", 1), ("done", None)]


def test_a_run_records_its_config_and_the_recorded_file_reproduces_it(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    small = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--progress", "none"]
    assert main(["train", *small, "--steps", "2", "--set", "optimizer.lr=1e-3", "--remat", "full",
                 "--out", str(first)]) == 0
    recorded = RunConfig.from_yaml_file(str(first / CONFIG_FILE))
    assert (recorded.optimizer.lr, recorded.recipe.options.remat.value, recorded.loop.steps) == (1e-3, "full", 2)
    assert main(["train", "--config", str(first / CONFIG_FILE), "--out", str(second)]) == 0

    def header_and_losses(run):
        records = [json.loads(line) for line in open(run / "metrics.jsonl")]
        return records[0]["run_config"], [r["loss"] for r in records if "loss" in r]

    (h1, l1), (h2, l2) = header_and_losses(first), header_and_losses(second)
    assert l1 == l2 and len(l1) == 2
    assert h1 == {k: v for k, v in recorded.to_dict().items() if k not in ("generation", "serve")}
    h1["checkpoint"].pop("out"), h2["checkpoint"].pop("out")
    assert h1 == h2


def test_no_command_module_imports_meshtrain_cli():
    """cli.py imports the commands; a command importing cli back would be a circle the import graph
    cannot see (cli loads them through importlib)."""
    offenders = []
    for path in sorted((ROOT / "meshtrain" / "commands").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "meshtrain":
                names = [f"meshtrain.{a.name}" for a in node.names]
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names = [node.args[0].value]
            offenders += [f"{path.name}: {n}" for n in names if n == "meshtrain.cli" or n.startswith("meshtrain.cli.")]
    assert offenders == []
    assert list((ROOT / "meshtrain" / "commands").glob("*.py"))


def test_train_config_round_trips_through_the_run_config():
    cfg = RunConfig().with_values({"recipe.options.attention": "ring", "recipe.name": "fsdp_cp",
                                   "recipe.options.load_balance": "none", "monitor.peak_flops_per_device": 1e14})
    assert RunConfig.from_train_config(cfg.train_config()) == cfg
    assert cfg.train_config().recipe_options == (("load_balance", "none"), ("attention", "ring"))
    with pytest.raises(ConfigError, match="recipe.options.load_balance='left': use one of"):
        cfg.with_values({"recipe.options.load_balance": "left"})


@pytest.mark.parametrize("command", ["plan", "train", "config show"])
def test_an_explicit_flag_beats_the_file_even_with_the_default_value(command, run_yaml):
    """defaults < --config < flags < --set: `--model small` (the default's value) still overrides the
    file's tiny, and --set overrides a flag."""
    got = resolved(COMMANDS[command] + ["--config", run_yaml, "--model", "small", "--grad-accum", "2",
                                        "--set", "recipe.options.grad_accum=4"]).config
    assert (got.model.name, got.recipe.name, got.recipe.options.grad_accum) == ("small", "fsdp_tp", 4)
    assert resolved(COMMANDS[command] + ["--config", run_yaml]).config.model.name == "tiny"


def test_the_generation_section_names_the_engines_weight_choices():
    """train.run_config cannot import meshtrain.generation (which imports train): its choices are the
    enums' values, kept equal here."""
    from meshtrain.generation.weights import WeightFormat, WeightMemory
    from meshtrain.train.run_config import GenerationSection

    assert setting_at("generation.quantize").choices == tuple(f.value for f in WeightFormat)
    assert setting_at("generation.weight_memory").choices == tuple(m.value for m in WeightMemory)
    assert GenerationSection().quantize == WeightFormat.NONE.value
    assert GenerationSection().weight_memory == WeightMemory.DEVICE.value


def test_hardware_not_given_is_this_hosts_chip_in_plan_as_in_train(capsys):
    """--hardware's one default: the device kind's profile (train's MFU peak, plan's estimates), cpu on a CPU."""
    import types

    import jax

    from meshtrain.train.metrics import hardware_of

    assert hardware_of(types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == "h100"
    assert hardware_of(types.SimpleNamespace(device_kind="TPU v5 lite")) == "tpu-v5e"
    assert hardware_of(jax.devices()[0]) is None
    assert main(["plan", "--model", "tiny", "--recipe", "fsdp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["name"] == "cpu"
