"""Peak memory and time of `meshtrain data tokenizer` and `data prepare` on one long single-line file
(issue 35: a 30 MB line took > 7 GiB in `prepare`, a 40 MB line did not finish `tokenizer`).

    python tools/bench_data_memory.py --mb 100                 # prose-like words on one line
    python tools/bench_data_memory.py --mb 100 --kind base64   # random base64: every word distinct
    python tools/bench_data_memory.py --file big.txt           # your own file

Each command runs in a child of its own; its peak RSS is the child's (``os.wait4``), its time the wall
clock. Not a test: run it by hand (minutes for 100 MB on 2 busy cores).
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import subprocess
import sys
import tempfile
import time


def write_line(path: str, mb: int, kind: str) -> None:
    rng = random.Random(0)
    size = mb * 1_000_000
    with open(path, "w") as f:
        if kind == "base64":
            while size > 0:
                block = base64.b64encode(rng.randbytes(3 << 18)).decode()[:size]
                f.write(block)
                size -= len(block)
            return
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
                 for _ in range(20000)]
        while size > 0:
            block = " ".join(rng.choices(words, k=100_000)) + " "
            f.write(block[:size])
            size -= len(block)


def measure(argv) -> tuple:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", *argv])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024, time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=100, help="size of the generated line (MB)")
    p.add_argument("--kind", choices=("prose", "base64"), default="prose")
    p.add_argument("--file", default=None, help="measure on this file instead of a generated one")
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        line = args.file or os.path.join(tmp, "line.txt")
        if not args.file:
            write_line(line, args.mb, args.kind)
        tok = os.path.join(tmp, "tok.json")
        rows = [("tokenizer", *measure(["data", "tokenizer", "--input", line, "--out", tok,
                                         "--vocab-size", str(args.vocab_size)]))]
        if rows[0][1] == 0:
            rows.append(("prepare", *measure(["data", "prepare", "--tokenizer", tok, "--input", line, "--out",
                                              os.path.join(tmp, "data"), "--progress", "none"])))
    print(f"\n{os.path.getsize(line) / 1e6 if args.file else args.mb:,.0f} MB single line ({args.kind})")
    for name, code, rss, secs in rows:
        print(f"data {name}: exit {code}, peak RSS {rss:,.0f} MiB, {secs:,.0f} s")
    return 0 if all(code == 0 for _, code, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
