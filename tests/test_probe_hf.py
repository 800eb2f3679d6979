"""The `hf` group of tools/probe_bad_input.py (tools/probe_groups/hf.py): `meshtrain import` and
`meshtrain export` against broken HuggingFace folders, broken runs and hostile output folders (issue
35). Split in four so that each part stays short; together they run every case of the group."""

import pytest
from probe_group import run_group


@pytest.mark.slow
def test_import_refuses_broken_configs():
    run_group("hf", expected_cases=14, only="import (config)", share_process=True)


@pytest.mark.slow
def test_import_refuses_broken_weights_and_reports_unread_tensors():
    run_group("hf", expected_cases=10, only="import (weights)", share_process=True)


@pytest.mark.slow
def test_import_output_full_read_only_and_interrupted():
    run_group("hf", expected_cases=3, only="import (output)")


@pytest.mark.slow
def test_export_refuses_non_decoder_runs_and_bad_outputs():
    run_group("hf", expected_cases=4, only="export:", share_process=True)


def test_the_four_parts_cover_the_whole_group(tmp_path):
    """Each case belongs to exactly one part above (no case left out of the tests, none run twice)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    from probe_groups import hf

    names = [case.name for case in hf.cases(str(tmp_path))]
    parts = {"import (config)": 14, "import (weights)": 10, "import (output)": 3, "export:": 4}
    assert len(set(names)) == len(names) == sum(parts.values())
    for part, count in parts.items():
        assert sum(part in name for name in names) == count, part
