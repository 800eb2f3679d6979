"""Rules of the code itself, read from the AST of meshtrain/ (issue 34): imports run one way.

* the import graph of the package's modules has no circle. Every import counts: top-level,
  inside functions, and ``importlib.import_module("meshtrain....")`` with a literal name (an
  f-string's literal prefix counts as an import of every module under it); only imports under
  ``if TYPE_CHECKING:`` do not, since they never run;
* no module imports the package root ``meshtrain`` (which only re-exports, lazily): a module that
  does sits above the whole package in the graph and loads everything;
* no module is over 600 lines and no function over 80.

Files that another branch is changing are listed in the ``KNOWN_*`` sets below, each with its
reason; those sets are meant to be emptied, never grown.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "meshtrain"
ROOT = "meshtrain"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

#: Circles that need commands/cli changes (owned by the cli/commands branch, which is removing the
#: commands -> cli imports). Each entry is the sorted tuple of a strongly connected component.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
#: Modules still over the line limit whose files another branch owns.
KNOWN_LONG_MODULES: set[str] = set()
#: ``module:function`` still over the function limit whose files another branch owns.
KNOWN_LONG_FUNCTIONS: set[str] = set()


def module_name(path: pathlib.Path) -> str:
    """``meshtrain/a/b.py`` -> ``meshtrain.a.b``; ``meshtrain/a/__init__.py`` -> ``meshtrain.a``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imports there never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _resolve(module: str, package: str, node: ast.ImportFrom) -> str:
    """The absolute module of a (possibly relative) ``from ... import``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str) -> list[str]:
    """The package modules an import of ``name`` runs: itself if it is one, else its nearest parent."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return [name] if name else []


def imports_of(module: str) -> dict[str, int]:
    """``{imported package module: first line}`` for every import ``module`` makes at run time."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(names, line):
        for name in names:
            found.setdefault(name, line)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    add(_targets(alias.name), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, package, node)
            if base.split(".")[0] != ROOT:
                continue
            for alias in node.names:  # `from meshtrain.x import y`: y may be a submodule
                add(_targets(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(ROOT):
                add(_targets(arg.value), node.lineno)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                prefix = str(arg.values[0].value)
                if prefix.startswith(ROOT + "."):
                    add(sorted(m for m in MODULES if m.startswith(prefix) and m != module), node.lineno)
    found.pop(module, None)
    return found


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the whole package."""
    return {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, dict[str, int]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return found


def test_the_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert "meshtrain.errors" in graph["meshtrain.mesh"]  # a top-level import
    assert sum(len(v) for v in graph.values()) > 300, "the walk found too few imports to be reading the package"
    cli = graph.get("meshtrain.cli", {})
    assert "meshtrain.commands.train" in cli, "importlib.import_module(f'meshtrain.commands.{...}') must count"


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    found = set(cycles(graph))
    new = sorted(found - KNOWN_CYCLES)

    def show(component):
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in graph[a] if b in component]
        return "\n    ".join(edges)
    assert not new, "import circles:\n  " + "\n  ".join(show(c) for c in new)


def test_no_module_imports_the_package_root():
    offenders = [f"{m} line {line}" for m, imports in import_graph().items() if m not in (ROOT, f"{ROOT}.__main__")
                 for target, line in imports.items() if target == ROOT]
    assert not offenders, f"modules that import the package root (import what you use instead): {offenders}"


def test_no_module_is_over_600_lines():
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    over = {m: n for m, n in long.items() if n > MAX_MODULE_LINES and m not in KNOWN_LONG_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"


def _long_functions():
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    yield f"{module}:{node.name}", length


def test_no_function_is_over_80_lines():
    over = {name: n for name, n in _long_functions() if name not in KNOWN_LONG_FUNCTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them): {over}"


def test_the_known_exceptions_are_still_needed():
    # an exception that no longer applies must leave its set, so the sets only shrink
    assert KNOWN_CYCLES <= set(cycles(import_graph()))
    assert KNOWN_LONG_FUNCTIONS <= {name for name, _ in _long_functions()}
    assert all(len(MODULES[m].read_text().splitlines()) > MAX_MODULE_LINES for m in KNOWN_LONG_MODULES)


def _heavy_modules_after(imports: str, return_all: bool = False):
    import processes

    code = (f"import sys\n{imports}\n"
            "print('HEAVY', sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'numpy') if m in sys.modules))")
    result = processes.run([sys.executable, "-c", code], timeout=120, cwd=str(PACKAGE.parent))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("HEAVY"))
    return line if return_all is False else result.stdout


def test_importing_the_package_loads_no_jax():
    line = _heavy_modules_after("import meshtrain, meshtrain.errors, meshtrain.events, meshtrain.distributed, "
                                "meshtrain.train.preflight")
    assert "'jax'" not in line, line


def test_the_supervisor_and_launch_load_no_jax():
    # `meshtrain launch` parses its child's command line and hands it a typed RunConfig, all without JAX
    # (its children load it); the command below fails after parsing, in launch's own checks.
    line = _heavy_modules_after("import meshtrain, meshtrain.supervisor, meshtrain.commands.launch; "
                                "import meshtrain.cli as cli; "
                                "rc = cli.main(['launch', '--processes', '2', '--elastic', 'train', '--steps', '2']); "
                                "assert rc == 2, rc")
    assert "'jax'" not in line and "'numpy'" not in line, line


def test_a_command_loads_only_its_own_module():
    # `meshtrain train --help` reads the flags of train alone: no other command's module, no JAX.
    line = _heavy_modules_after("import meshtrain.cli as cli\n"
                                "try:\n    cli.main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
                                "print('COMMANDS', *sorted(m for m in sys.modules if m.startswith('meshtrain.commands.')))",
                                return_all=True)
    assert "'jax'" not in line, line
    loaded = set(next(w for w in line.splitlines() if w.startswith("COMMANDS")).split()[1:])
    helpers = {f"meshtrain.commands.{m}" for m in ("common", "run_flags", "recipe_flags")}
    assert loaded - helpers == {"meshtrain.commands.train"}, loaded


#: ``raise ValueError`` left on purpose: internal signals that their caller catches, never shown to a user.
INTERNAL_VALUE_ERRORS = {
    "meshtrain.checkpoint.integrity:read_manifest",   # caught by integrity.check_step: "manifest unreadable"
}
#: cli.py and commands/ belong to the CLI branch, which converts its own.
CLI_MODULES = ("meshtrain.cli", "meshtrain.commands")


def _value_errors():
    for module, path in MODULES.items():
        if module.startswith(CLI_MODULES):
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                            getattr(node.exc.func, "id", None) == "ValueError":
                        yield f"{module}:{fn.name}"


def test_user_errors_are_typed():
    found = set(_value_errors())
    assert found - INTERNAL_VALUE_ERRORS == set(), (
        f"raise a typed error from meshtrain.errors (ConfigError, RulesError, ...) instead of ValueError in "
        f"{sorted(found - INTERNAL_VALUE_ERRORS)}")
    assert INTERNAL_VALUE_ERRORS <= found


#: What ``dir(meshtrain)`` showed when the package root imported everything eagerly (before issue 34).
PUBLIC_BEFORE_LAZY = """
AbstractState AttentionKind AxisRules AxisTypes BUILTIN_RECIPES BatchLayout BatchLeaf BatchSpec
CheckpointError Checkpointer ConfigError Context ContextKind DataParallel Expert FSDP FlashBackend HSDP Hook
LOGICAL_AXES LayerLoop LeafPlan LoadBalance LocalAttention LossFn MESH_AXES MeshError MeshSpec MeshtrainError
ModelFactory ModelRules NonFinite Offload ParamInfo PathRules Pipeline PipelineParts PlanError Recipe
RecipeError Remat Restored Rule RulesError SaveResult Schedule ShardingPlan StepContext StepInfo Stop
Strategy Tensor TrainState ZeRO ZeroStage __version__ abstract abstract_state abstract_train_state annotate
attention axes batch_layout checkpoint constrain data distributed errors folders generate generation
get_recipe hardware hf init_state inspect_checkpoint interrupts list_params losses make_eval_step
make_grad_fn make_plan make_train_step master_weights mesh models next_token_loss offload parallel plan
precision recipes register_logical_axis register_recipe register_strategy remat rules scan_layers
sequence_permutation settings state state_shardings strategies train
""".split()


def test_the_lazy_root_keeps_every_public_name():
    import importlib

    import meshtrain

    missing = sorted(set(PUBLIC_BEFORE_LAZY) - set(dir(meshtrain)))
    assert not missing, f"names the package root no longer shows: {missing}"
    for name in PUBLIC_BEFORE_LAZY:
        assert getattr(meshtrain, name) is not None
    # the TYPE_CHECKING imports (what type checkers see) name the same objects as the lazy table
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    checked = {}
    type_checking = [n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    for node in (n for block in type_checking for n in ast.walk(block)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                checked[alias.name] = node.module if node.module != ROOT else f"{ROOT}.{alias.name}"
    assert set(checked) == set(meshtrain.__all__), sorted(set(checked) ^ set(meshtrain.__all__))
    for name, module in checked.items():
        value = importlib.import_module(module)
        assert getattr(meshtrain, name) is (value if module == f"{ROOT}.{name}" else getattr(value, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        meshtrain.nothing_here
