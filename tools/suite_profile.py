"""Where the suite's time goes: compiling and running (CPU) against waiting, per file and per test.

Run the suite with ``MESHTRAIN_TEST_CPU_LOG=FILE`` (tests/conftest.py writes one JSON line per test),
then::

    python tools/suite_profile.py FILE            # per file, most CPU first, and the 20 most idle tests
    python tools/suite_profile.py FILE --top 40
    python tools/suite_profile.py FILE --children KIDS   # MESHTRAIN_TEST_CHILD_LOG=KIDS: children per test
    python tools/suite_profile.py FILE [FILE ...] --write-order tests/file_seconds.json

``--write-order`` keeps each test file's wall seconds (the mean over the logs given) in the JSON file
tests/conftest.py orders the suite by: the longest files are handed to the workers first, so that none
runs alone at the end (longest-processing-time-first scheduling of ``--dist loadfile``'s files).

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
    p.add_argument("log", nargs="+", help="the file(s) MESHTRAIN_TEST_CPU_LOG named (the first is summarised)")
    p.add_argument("--top", type=int, default=20, help="how many files and idle tests to list")
    p.add_argument("--children", metavar="FILE",
                   help="also the Python children's CPU per test, from the file MESHTRAIN_TEST_CHILD_LOG named")
    p.add_argument("--write-order", metavar="JSON",
                   help="write each test file's mean wall seconds over the logs (tests/file_seconds.json)")
    args = p.parse_args(argv)
    if args.write_order:
        return _write_order([read(path) for path in args.log], args.write_order)
    if args.children:
        _print_children(read(args.children), args.top)
    rows = read(args.log[0])
    if not rows:
        print(f"{args.log[0]}: no tests recorded", file=sys.stderr)
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
    _print_tail(rows)
    idle = sorted(rows, key=lambda r: -(r["wall_s"] - r["cpu_s"] - r["children_cpu_s"]))[:args.top]
    print(f"\nmost waiting (wall - CPU):\n{'idle s':>8} {'wall s':>8}  test")
    for r in idle:
        print(f"{r['wall_s'] - r['cpu_s'] - r['children_cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")
    return 0


def _write_order(logs, path: str) -> int:
    per_log = []
    for rows in logs:
        files = collections.Counter()
        for r in rows:
            files[r["test"].split("::")[0].rsplit("/", 1)[-1]] += r["wall_s"]
        per_log.append(files)
    names = set().union(*per_log)
    mean = {name: round(sum(f[name] for f in per_log if name in f) / sum(name in f for f in per_log), 1)
            for name in names}
    if not mean:
        print("no tests recorded in the logs", file=sys.stderr)
        return 1
    order = dict(sorted(mean.items(), key=lambda kv: (-kv[1], kv[0])))
    with open(path, "w") as f:
        json.dump({"what": "each test file's wall seconds (mean over the suite runs' CPU logs); tests/conftest.py "
                           "hands the longest to the workers first. Rewrite with tools/suite_profile.py LOG... "
                           "--write-order", "runs": len(logs), "seconds": order}, f, indent=1)
        f.write("\n")
    print(f"{path}: {len(order)} files, {sum(order.values()):.0f} s of test wall time")
    return 0


def _print_children(rows, top: int) -> None:
    """CPU seconds of the Python children each test started (tests/child_site/sitecustomize.py writes a line as
    each exits; a child killed by a signal writes none), and per kind of command. The xdist workers are
    children of the controller too: their lines (no test, ``-c``) are left out."""
    kids = [r for r in rows if r["test"]]
    by_test = collections.defaultdict(lambda: [0, 0.0])
    by_command = collections.defaultdict(lambda: [0, 0.0])
    for r in kids:
        for table, key in ((by_test, r["test"]), (by_command, " ".join(a.rsplit("/", 1)[-1] for a in r["argv"][:2]))):
            table[key][0] += 1
            table[key][1] += r["cpu_s"]
    print(f"{len(kids)} children: {sum(r['cpu_s'] for r in kids):.0f} CPU s")
    for title, table in (("test", by_test), ("command", by_command)):
        print(f"{'CPU s':>8} {'count':>5}  {title}")
        for key, (n, cpu) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"{cpu:8.1f} {n:5d}  {key[:140]}")
    print()


def _print_tail(rows) -> None:
    """When each worker finished its last test (logs with ``end_unix`` and ``worker``): the seconds the
    suite ran with a worker already done are cores left idle (on 2 cores, while fewer than 2 workers remain)."""
    ends = collections.defaultdict(float)
    starts = []
    for r in rows:
        if "end_unix" in r and r.get("worker"):
            ends[r["worker"]] = max(ends[r["worker"]], r["end_unix"])
            starts.append(r["end_unix"] - r["wall_s"])
    if len(ends) < 2:
        return
    first, last = min(starts), max(ends.values())
    print(f"\nworkers' last test ended at (s after the first test started; the suite: {last - first:.0f} s):")
    for worker, end in sorted(ends.items(), key=lambda kv: kv[1]):
        last_test = max((r for r in rows if r.get("worker") == worker), key=lambda r: r["end_unix"])
        print(f"  {worker:6s} {end - first:7.0f}  {last_test['test']}")


if __name__ == "__main__":
    sys.exit(main())
