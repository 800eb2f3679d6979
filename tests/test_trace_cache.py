"""The planner's traced activation formulas kept on disk between processes (meshtrain.analysis.trace_cache):
read back equal to a fresh trace, traced again when the file is damaged, from other code or unwritable,
and never read by a process whose traced code was patched."""

import json
import os

import pytest

from meshtrain.analysis import activations, trace_cache
from meshtrain.analysis.activations import saved_activations


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, this process's memo empty before and after (and the disk layer on: a test that
    patched the traced code earlier in this worker turned it off)."""
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(trace_cache, "_ENABLED", [True])
    activations._traced_activations.cache_clear()
    traced = []
    trace = activations._trace_activations
    monkeypatch.setattr(activations, "_trace_activations", lambda *a: traced.append(a) or trace(*a))
    yield tmp_path / "traces", traced
    activations._traced_activations.cache_clear()


def test_a_second_process_reads_the_formulas_the_first_traced(cache):
    folder, traced = cache
    first = saved_activations("full", "bfloat16", True, "flash")
    files = sorted(os.listdir(folder))
    assert len(traced) == 1 and len(files) == 1 and files[0].startswith("activations-"), files
    activations._traced_activations.cache_clear()   # as a new process: only the file is left
    again = saved_activations("full", "bfloat16", True, "flash")
    assert again == first and len(traced) == 1
    assert again.tensors and again.remat.value == "full"
    saved_activations("none", "bfloat16", True, "flash")   # another key: another trace, another file
    assert len(traced) == 2 and len(os.listdir(folder)) == 2


@pytest.mark.parametrize("damage", ["{not json", '{"remat": "full"}', '{"remat": "sideways", "tensors": []}', ""])
def test_a_damaged_file_is_traced_again_and_rewritten(cache, damage):
    folder, traced = cache
    first = saved_activations("none", "float32")
    (path,) = folder.iterdir()
    path.write_text(damage)
    activations._traced_activations.cache_clear()
    assert saved_activations("none", "float32") == first and len(traced) == 2
    assert json.loads(path.read_text())["remat"] == "none"


def test_other_code_does_not_read_the_file(cache, monkeypatch):
    folder, traced = cache
    saved_activations("none", "float32")
    activations._traced_activations.cache_clear()
    monkeypatch.setattr(trace_cache, "code_fingerprint", lambda: "other code")
    saved_activations("none", "float32")
    assert len(traced) == 2 and len(os.listdir(folder)) == 2


def test_an_unwritable_folder_or_off_costs_the_trace_not_the_run(cache, monkeypatch, tmp_path):
    folder, traced = cache
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(blocker))   # traces/ cannot be made under a file
    first = saved_activations("none", "float32")
    activations._traced_activations.cache_clear()
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", "off")
    assert saved_activations("none", "float32") == first and len(traced) == 2
    assert not folder.exists()


def test_a_patched_process_neither_reads_nor_writes(cache):
    folder, traced = cache
    saved_activations("none", "float32")
    saved_activations.cache_clear()   # what a test that monkeypatches the traced code calls
    saved_activations("none", "float32")
    assert len(traced) == 2 and len(os.listdir(folder)) == 1
    assert trace_cache.cache_dir() is None
