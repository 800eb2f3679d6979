"""Python's cyclic garbage collector tuned for the suite's processes: the test workers (conftest.py) and every
Python child a test starts (``sitecustomize.py`` here, which conftest puts on the children's ``PYTHONPATH``).

Why: tracing and lowering a step makes millions of small, long-lived Python objects (jaxpr equations, MLIR
handles, tree nodes). With CPython's default thresholds ``(700, 10, 10)`` the collector scans the young ones
after every 700 allocations and the old ones every 70,000, and finds almost nothing to free: measured on
2 busy cores, tracing and lowering four tiny steps (dp, fsdp, fsdp_tp, pp) took 1.71-2.09 CPU s by default
and 1.58 with ``(10_000, 10, 10)``; a 2-step ``meshtrain train --model tiny`` child (warm compilation cache)
took 4.44-4.93 user s by default and 4.08-4.75 tuned. Full collections still run (every 10,000 × 10 × 10
allocations and CPython's own 25 % rule), so cyclic garbage holding arrays is still freed within a step or two.
What a program computes is unchanged: the collector only decides when unreachable cycles are freed.

Measured per file (``MESHTRAIN_TEST_CPU_LOG``, ``-n0``, CPU s of the tests and their children, default -> tuned):
test_notebooks 99.6 -> 93.8, test_distributed 47.5 -> 44.4; in-process test_parity 37.4 -> 37.4.
Set ``MESHTRAIN_TEST_GC=default`` to keep CPython's own thresholds (in the workers and every child).

Example (what both callers do)::

    import suite_gc
    suite_gc.tune()
"""

import gc
import os

#: Allocations between young-generation scans, then young scans per middle scan and middle scans per full one.
THRESHOLDS = (10_000, 10, 10)


def tune() -> None:
    """Set :data:`THRESHOLDS` unless ``MESHTRAIN_TEST_GC=default``."""
    if os.environ.get("MESHTRAIN_TEST_GC") != "default":
        gc.set_threshold(*THRESHOLDS)

