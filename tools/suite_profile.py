"""Where the suite's time goes: compiling and running (CPU) against waiting, per file and per test.

Run the suite with ``MESHTRAIN_TEST_CPU_LOG=FILE`` (tests/conftest.py writes one JSON line per test),
then::

    python tools/suite_profile.py FILE            # per file, most CPU first, and the 20 most idle tests
    python tools/suite_profile.py FILE --top 40

A test whose wall time is far above its CPU time (its own and its children's) waits: for a hang bound,
a peer's timeout, a supervisor's back-off. Those are the tests a third worker can overlap; tests whose
CPU is near their wall time are what the cores are busy with.
"""

import argparse
import collections
import json
import sys


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="the file MESHTRAIN_TEST_CPU_LOG named")
    p.add_argument("--top", type=int, default=20, help="how many files and idle tests to list")
    args = p.parse_args(argv)
    rows = read(args.log)
    if not rows:
        print(f"{args.log}: no tests recorded", file=sys.stderr)
        return 1
    files = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f[0] += 1
        f[1] += r["wall_s"]
        f[2] += r["cpu_s"] + r["children_cpu_s"]
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r["cpu_s"] + r["children_cpu_s"] for r in rows)
    print(f"{len(rows)} tests: {wall:.0f} s of test wall time, {cpu:.0f} CPU s (theirs and their children's), "
          f"{100 * cpu / wall:.0f} % busy")
    print(f"{'CPU s':>8} {'wall s':>8} {'tests':>5}  file")
    for name, (n, w, c) in sorted(files.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{c:8.1f} {w:8.1f} {n:5d}  {name}")
    failed = [r["test"] for r in rows if r.get("failed")]
    if failed:
        print(f"\n{len(failed)} failed (setup, call or teardown):")
        for name in failed:
            print(f"  {name}")
    idle = sorted(rows, key=lambda r: -(r["wall_s"] - r["cpu_s"] - r["children_cpu_s"]))[:args.top]
    print(f"\nmost waiting (wall - CPU):\n{'idle s':>8} {'wall s':>8}  test")
    for r in idle:
        print(f"{r['wall_s'] - r['cpu_s'] - r['children_cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
