"""Every notebook in notebooks/ runs top to bottom on CPU (8 simulated devices), so none of them rots.

Notebooks are committed without outputs; this executes them in a fresh kernel with nbclient.
"""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(__file__))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
BUDGET_S = 600  # per cell: a hang guard only (each notebook takes well under 30 s on 2 idle cores)


def test_there_are_notebooks():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"01_sharding_tour.ipynb", "02_collectives_per_recipe.ipynb", "03_memory_per_recipe.ipynb",
            "04_planning_llama3_70b.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_clean_and_sets_8_devices_first(path):
    book = nbformat.read(path, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "commit without outputs"
    first = code[0].source.splitlines()
    assert first[0] == "import jax" and first[1].startswith('jax.config.update("jax_num_cpu_devices", 8)')


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
    book = nbformat.read(path, as_version=4)
    env_keep = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        NotebookClient(book, timeout=BUDGET_S, kernel_name="python3",
                       resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    finally:
        if env_keep is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = env_keep
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
