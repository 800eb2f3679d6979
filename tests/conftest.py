"""8 simulated CPU devices for the whole suite, set once before JAX starts its backends."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.json from the code")


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")
