"""Writes the embedded default corpus, ``meshtrain/data/corpus/python-stdlib.tar.xz``, and prints its
sha256 (pin it as ``meshtrain.data.corpus.CORPUS_SHA256``).

The corpus is CPython 3.11.7's standard library ``.py`` sources, sorted by path, without tests and
vendored packages, up to 16 MiB (580 files, 11.0 MB; 1.8 MB compressed). It ships with meshtrain so
that every Python reads the same bytes: read from the running interpreter, it differed between 3.10,
3.11 and 3.12 and moved the main job's figures (issue 35). Run this only to change the corpus on
purpose (then update the pinned hash and the README's figures):

    python tools/make_default_corpus.py --stdlib /path/to/python3.11/lib/python3.11
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import os
import sys
import sysconfig
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "meshtrain", "data", "corpus", "python-stdlib.tar.xz")
#: folders left out: tests, IDLE, vendored or generated code
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"}


def corpus_files(stdlib: str, max_bytes: int = 16 << 20):
    found = sorted(f for f in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                   if os.path.isfile(f) and not set(os.path.relpath(f, stdlib).split(os.sep)[:-1]) & SKIP_DIRS)
    picked, total = [], 0
    for f in found:
        size = os.path.getsize(f)
        if total + size > max_bytes:
            break
        picked.append(f)
        total += size
    return picked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the standard library folder to read")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    files = corpus_files(args.stdlib)
    buf = io.BytesIO()
    # Fixed metadata (times, owners, modes) so the archive's bytes depend on the sources alone.
    with tarfile.open(fileobj=buf, mode="w:xz", format=tarfile.PAX_FORMAT, preset=9) as tar:
        for f in files + [os.path.join(args.stdlib, "LICENSE.txt")]:
            data = open(f, "rb").read()
            info = tarfile.TarInfo(os.path.relpath(f, args.stdlib))
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    with open(args.out, "wb") as fh:
        fh.write(buf.getvalue())
    print(f"wrote {args.out}: {len(files)} files, {sum(map(os.path.getsize, files)):,} bytes "
          f"({len(buf.getvalue()):,} compressed); sha256 {hashlib.sha256(buf.getvalue()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
