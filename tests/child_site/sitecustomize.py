"""Imported at start-up by every Python child a test starts: conftest.py puts this folder first on the
children's ``PYTHONPATH`` (``helpers.cache_every_process`` does the same for an environment built from scratch).
Three things, none of them changing what a child computes:

1. the garbage collector's thresholds of the suite (``suite_gc.py`` says why and what they save);
2. every process of a multi-process run writes its own compiled programs to the suite's persistent
   compilation cache, not only process 0;
3. JAX's search for a ROCm plugin reads only the installed distributions named like one (``_RocmScan``).

Why (2): JAX writes cache entries from process 0 only (``jax._src.compiler._cache_write``: to spare
shared file systems the contention). On XLA:CPU the executables of processes 1.. have keys of their
own (their compile options name the process), so those processes missed the cache every time and
compiled every program again in every launch and every restart: about half of a 2-process launch's
CPU time in the suite. Here the processes write different keys to a local folder, so nothing
contends. What a run computes is unchanged: a cache hit loads the program the same compiler built.

The patch is applied when ``jax._src.compiler`` is first imported (a child that never imports JAX,
such as the launcher's guard, pays nothing). Set ``MESHTRAIN_TEST_CACHE_EVERY_PROCESS=0`` to leave
JAX's own behaviour.
"""

import importlib.abc
import importlib.machinery
import os
import sys

import suite_gc

suite_gc.tune()

_MODULE = "jax._src.compiler"


def _patch(compiler) -> None:
    """Wrap ``_cache_write`` so that a process other than 0 writes its entries too."""
    from jax._src import compilation_cache, config, distributed

    original = compiler._cache_write

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception:   # as JAX's own writer: a failed write costs a later compile, never the run
            pass

    compiler._cache_write = cache_write


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``jax._src.compiler`` as usual, then patches it right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        loader.exec_module = exec_and_patch
        sys.meta_path.remove(self)   # once
        return spec


if os.environ.get("MESHTRAIN_TEST_CACHE_EVERY_PROCESS", "1") != "0":
    sys.meta_path.insert(0, _PatchOnImport())


class _RocmScan(importlib.abc.MetaPathFinder):
    """While ``jax._src.numpy.array_constructors`` executes, ``importlib.metadata.distributions()`` yields only
    the distributions whose folder is named like a ROCm plugin's (``jax_rocm*``), or that have no folder.

    Why: on import that module reads the METADATA of every installed distribution to find a ``jax-rocm*-plugin``
    (JAX 0.10.2): 120 of them in the suite's venv, 0.06 CPU s in every process that imports JAX, and the suite
    starts hundreds. A ROCm plugin, if one is installed, is still found (its ``.dist-info`` folder's name is
    its normalised name, ``jax_rocm7_plugin-...``). Set ``MESHTRAIN_TEST_ROCM_SCAN=default`` for JAX's own scan.
    """

    MODULE = "jax._src.numpy.array_constructors"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_scanning_rocm_only(module):
            import importlib.metadata as metadata

            everything = metadata.distributions

            def rocm_named(**kwargs):
                for dist in everything(**kwargs):
                    folder = getattr(dist, "_path", None)
                    if folder is None or os.path.basename(str(folder)).lower().startswith(("jax_rocm", "jax-rocm")):
                        yield dist
            metadata.distributions = rocm_named
            try:
                exec_module(module)
            finally:
                metadata.distributions = everything
        spec.loader.exec_module = exec_scanning_rocm_only
        sys.meta_path.remove(self)   # once
        return spec


if os.environ.get("MESHTRAIN_TEST_ROCM_SCAN") != "default":
    sys.meta_path.insert(0, _RocmScan())


def _log_cpu_at_exit(path: str) -> None:
    """``MESHTRAIN_TEST_CHILD_LOG=FILE``: every child appends one JSON line at exit: the test that started it
    (``PYTEST_CURRENT_TEST``), its command line and its CPU seconds (all threads); ``tools/suite_profile.py
    --children FILE`` sums them. A child killed by a signal writes nothing."""
    import atexit
    import json
    import resource
    import time

    started = time.monotonic()

    def record():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "argv": sys.argv[:12],
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "wall_s": round(time.monotonic() - started, 3)}
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass
    atexit.register(record)


if os.environ.get("MESHTRAIN_TEST_CHILD_LOG"):
    _log_cpu_at_exit(os.environ["MESHTRAIN_TEST_CHILD_LOG"])
