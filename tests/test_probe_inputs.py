"""Group ``inputs`` of tools/probe_bad_input.py (issue 35): damaged prepared token folders, generation
on a run that is not a decoder's or has a damaged header, stop ids outside the vocabulary, bad rules
files, plan flags that used to be ignored, ``--dcn`` on one host, sequence lengths the context axes do
not divide. Each part runs in a probe session of its own (its name tag, tools/probe_groups/inputs.py)."""

from probe_group import run_group


def test_damaged_prepared_token_folders():
    run_group("inputs", expected_cases=9, only="[data]")


def test_generate_on_runs_it_cannot_use():
    run_group("inputs", expected_cases=8, only="[run]")


def test_rules_files_and_plan_train_flags():
    run_group("inputs", expected_cases=10, only="[flags]")
