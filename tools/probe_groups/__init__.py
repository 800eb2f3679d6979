"""Groups of bad-input and fault cases for ``tools/probe_bad_input.py``: each module has
``cases(tmp) -> List[Case]``, and a test ``tests/test_probe_<module>.py`` runs its group."""
