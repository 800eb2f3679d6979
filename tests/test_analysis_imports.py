"""`analysis` uses the plan and the public step builders, never training internals (DESIGN's import order)."""

import ast
import pathlib

import pytest

import meshtrain

PACKAGE = pathlib.Path(meshtrain.__file__).parent
#: what analysis may take from meshtrain.train: the public step builders
PUBLIC_STEP = {"meshtrain.train.step": {"make_train_step", "make_eval_step"}}


def _train_imports(path: pathlib.Path):
    """``(module, name)`` for every import of ``meshtrain.train`` or below in ``path``, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshtrain.train"):
            yield from ((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, "*") for alias in node.names if alias.name.startswith("meshtrain.train"))


@pytest.mark.parametrize("module", sorted(p.name for p in (PACKAGE / "analysis").glob("*.py")))
def test_analysis_imports_only_the_public_step_builders_from_train(module):
    bad = [f"{mod}.{name}" for mod, name in _train_imports(PACKAGE / "analysis" / module)
           if name not in PUBLIC_STEP.get(mod, ())]
    assert not bad, f"meshtrain/analysis/{module} imports training internals {bad}"


def test_the_moved_names_keep_their_old_homes():
    from meshtrain import losses, plan, precision
    from meshtrain.train import step

    assert step.next_token_loss is losses.next_token_loss is meshtrain.next_token_loss
    assert step.unpack_loss is losses.unpack_loss and step.LossFn is losses.LossFn is meshtrain.LossFn
    assert step.RESERVED_METRICS is losses.RESERVED_METRICS
    assert step.gradient_shardings is plan.gradient_shardings and step.cast_floats is precision.cast_floats


#: The mark an in-function ``meshtrain`` import carries, with why it is not at the top (a cycle it
#: dodges, or a heavy import it keeps off a path that must stay light): ``from x import y  # lazy: why``.
LAZY_MARK = "# lazy:"


def _unmarked_function_imports(path: pathlib.Path):
    """Line numbers of ``meshtrain`` imports inside functions of ``path`` without ``# lazy: <reason>``."""
    lines = path.read_text().splitlines()
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(m == "meshtrain" or m.startswith("meshtrain.") for m in modules):
                text = " ".join(lines[node.lineno - 1:node.end_lineno])
                reason = text.partition(LAZY_MARK)[2].strip()
                if not reason:
                    yield node.lineno


@pytest.mark.parametrize("module", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))
def test_in_function_meshtrain_imports_say_why_they_are_lazy(module):
    lines = sorted(set(_unmarked_function_imports(PACKAGE / module)))
    assert not lines, (f"meshtrain/{module} lines {lines}: move these imports to the module's top, or, if they dodge "
                       f"a cycle or keep a heavy import off a light path, end them with '{LAZY_MARK} <reason>'")
