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
